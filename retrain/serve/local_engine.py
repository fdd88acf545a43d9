"""The Engine over the local backend: one LocalModel, one LocalBackend (adapter + AdamW) per
training model, sampler snapshots as frozen adapters on the same model.

Tinker semantics on top of the local backend's: Tinker losses are sums over every position
of every datum. So each datum is trained on all of its positions (mask 1; positions the
client does not want trained carry advantage 0) with the `sum` aggregation, and the losses
are the shared definitions of backends/local/training/policy_losses.py.

LoRA hyper-parameters other than the rank (alpha, dropout, target modules) are the local
backend's defaults (`[model]` in the config), so a run against `retrain serve` trains the
same adapter as a local run with the same seed.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
import logging
import math
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from retrain.algorithms import aggregation, losses
from retrain.backends.base import (
    AdamParams,
    BackendError,
    Datum,
    DivergedError,
    LossConfig,
    LossOutput,
    SamplingParams,
)
from retrain.backends.local.backend import LocalBackend
from retrain.backends.local.checkpoint import ADAPTER_WEIGHTS
from retrain.backends.local.model import LocalModel
from retrain.backends.local.sampling.exact import OnToken, SamplingStopped
from retrain.config.sections import ModelConfig
from retrain.serve.door.backlog import default_bound, owed
from retrain.serve.engine import EngineError, SampleResult

log = logging.getLogger("retrain.serve")
TRIM_AFTER = 2**20  # a batch owing more tokens of KV cache gives its memory back once done


class LocalEngine:
    """Serves one base model; adapters are named by the server's model ids."""

    arch = "causal-lm"

    def __init__(self, model: LocalModel, name: str, lora: ModelConfig | None = None):
        self.model = model
        self.base_model = name
        self.tokenizer_id = model.name_or_path
        self.vocab_size = model.vocab_size
        self.max_context = getattr(model.base.config, "max_position_embeddings", None)
        self.lora = lora or ModelConfig()
        self._backends: dict[str, LocalBackend] = {}
        self._snapshot_of: dict[str, str] = {}  # snapshot adapter -> training model id
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._queued: dict[tuple, list[_Queued]] = {}
        self._sampler = self._new_backend("base", rank=self.lora.lora_rank, seed=0)
        self._seeds = np.random.default_rng()  # for unseeded requests batched with seeded ones

    @classmethod
    def load(cls, name: str, dtype: str = "auto", device: str = "auto",
             threads: int = 0) -> LocalEngine:
        """Load `name` (a built-in name, a folder or a cached hub id) once."""
        from retrain.backends.models import resolve_model

        path = resolve_model(name)
        return cls(LocalModel.load(path, dtype, device, threads), name)

    @property
    def dtype_name(self) -> str:
        """The dtype the model computes in, e.g. "float32" or "bfloat16"."""
        return str(self.model.base.dtype).removeprefix("torch.")

    def queued_tokens_bound(self) -> int:
        """The default bound on the sampling taken on at once (serve.backlog): the tokens of
        KV cache that half the device's memory holds."""
        total = None
        if self.model.device.type == "cuda":
            import torch

            total = torch.cuda.get_device_properties(self.model.device).total_memory
        return default_bound(self.model.cost_model().kv_bytes_per_token, total)

    def accepts(self, base_model: str) -> bool:
        return base_model in (self.base_model, self.model.name_or_path)

    def _new_backend(self, prefix: str, rank: int, seed: int) -> LocalBackend:
        with self._lock:
            name = f"{prefix}{next(self._ids)}"
        m = self.lora
        return LocalBackend.new_adapter(self.model, name, rank, m.lora_alpha, m.lora_dropout,
                                        m.lora_target_modules, seed=seed)

    def _backend(self, model_id: str) -> LocalBackend:
        backend = self._backends.get(model_id)
        if backend is None:
            raise EngineError(f"no adapter for model {model_id}")
        return backend

    # ------------------------------------------------------------------ adapters

    def create_adapter(self, model_id: str, rank: int, seed: int | None) -> None:
        self._backends[model_id] = self._new_backend("train", rank, seed or 0)

    def drop_adapter(self, model_id: str) -> None:
        backend = self._backends.pop(model_id, None)
        if backend is not None:
            backend.close()
            self._delete(backend.adapter)

    def _delete(self, adapter: str) -> None:
        with warnings.catch_warnings():  # peft warns when the active adapter goes away
            warnings.simplefilter("ignore", UserWarning)
            self.model.delete_adapter(adapter)

    # ------------------------------------------------------------------ training

    def forward_backward(self, model_id: str, data: list[Datum], loss_fn: str,
                         config: dict[str, float], forward_only: bool) -> LossOutput:
        backend = self._backend(model_id)
        loss = _loss_config(loss_fn, config)
        if forward_only:
            return _forward_only(backend, data, loss)
        out = backend.forward_backward([_local_datum(d, loss_fn) for d in data], loss)
        metrics = {f"{k}:{how}": out.metrics[k] for k, how in
                   (("clip_fraction", "mean"), ("ratio_mean", "mean"), ("ratio_max", "max"))
                   if k in out.metrics}
        return LossOutput(out.loss, [np.asarray(lp, dtype=np.float32) for lp in out.logprobs],
                          metrics)

    def optim_step(self, model_id: str, adam: AdamParams) -> dict[str, float]:
        """A non-finite loss or gradient is not applied (metrics `skipped_nonfinite` = 1); an
        update that would make the weights non-finite is undone and refused."""
        try:
            out = self._backend(model_id).optim_step(adam)
        except DivergedError as exc:
            raise EngineError(f"optim_step not applied: {exc}") from None
        return {"grad_norm": out.grad_norm, **out.metrics}

    # ------------------------------------------------------------------ checkpoints

    def save_state(self, model_id: str, folder: Path) -> None:
        backend = self._backend(model_id)
        backend.checkpoint_dir = folder.parent  # the local backend writes <dir>/<name>
        try:
            backend.save_state(folder.name)
        except DivergedError as exc:  # never saves non-finite weights
            raise EngineError(str(exc)) from None

    def load_state(self, model_id: str, folder: Path, optimizer: bool) -> None:
        backend = self._backend(model_id)
        try:
            backend.load_state(str(folder))
        except BackendError as exc:
            raise EngineError(str(exc)) from None
        if not optimizer:
            backend.optimizer.state.clear()

    def snapshot(self, model_id: str) -> str:
        backend = self._backend(model_id)
        with self._lock:
            name = f"snap{next(self._ids)}"
        backend.snapshot(name)
        self._snapshot_of[name] = model_id
        return name

    def drop_snapshot(self, snap: Any) -> None:
        if snap is not None and self._snapshot_of.pop(snap, None) is not None:
            self._delete(snap)

    def write_snapshot(self, snap: str, folder: Path) -> None:
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        with self.model.lock:
            weights = get_peft_model_state_dict(self.model.peft, adapter_name=snap)
            weights = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
            save_file(weights, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
            self.model.lora_configs[snap].save_pretrained(str(folder))

    def read_snapshot(self, folder: Path) -> str:
        """A frozen adapter from a sampler or training checkpoint folder."""
        from peft import LoraConfig, set_peft_model_state_dict
        from safetensors.torch import load_file

        with self._lock:
            name = f"snap{next(self._ids)}"
        config = LoraConfig.from_pretrained(str(folder))
        with self.model.lock:
            self.model.add_adapter(name, config, seed=0)
            try:
                weights = load_file(str(folder / ADAPTER_WEIGHTS),
                                    device=str(self.model.device))
                set_peft_model_state_dict(self.model.peft, weights, adapter_name=name)
            except BaseException:  # truncated or foreign weights: no half-made adapter stays
                self._delete(name)
                raise
            for p in self.model.adapter_params(name).values():
                p.requires_grad_(False)
        self._snapshot_of[name] = ""
        return name

    # ------------------------------------------------------------------ sampling

    def sample(self, snap: Any, prompt: list[int], n: int, params: SamplingParams,
               prompt_logprobs: bool, cancel: threading.Event | None = None,
               on_token: OnToken | None = None) -> SampleResult:
        """Requests that wait for the model together are decoded together: whichever gets
        the model lock first decodes every queued request with the same weights and
        settings in one batch; when any of them has a seed, each prompt draws from its own
        seed (a random one where the request gave none) and prompts of one length are decoded
        together (padding changes the numbers, in bfloat16 enough to flip a draw), so a seeded
        request's completions do not depend on what it was batched with. `on_token` hears
        of this request's tokens as they are drawn (index among its `n`, token, log-prob,
        top log-probs). A request cancelled while it is decoded (`cancel` set: its client is
        gone) leaves the batch at the next decoding step, the others decode on."""
        key = (snap, n, params.max_tokens, params.temperature, params.top_p,
               params.stop_tokens, params.stop_strings, params.top_logprobs)
        mine = _Queued(prompt, params.seed, on_token, cancel)
        with self._lock:
            self._queued.setdefault(key, []).append(mine)
        with self.model.lock:
            if mine.result is None and mine.error is None:
                with self._lock:
                    batch = self._queued.pop(key, [])
                for part in _by_length(batch):
                    self._decode(part, snap, n, params)
                if owed([len(q.prompt) for q in batch], n, params.max_tokens) > TRIM_AFTER:
                    _give_memory_back()
        if isinstance(mine.error, DivergedError | SamplingStopped):  # not a server fault
            raise EngineError(str(mine.error))
        if mine.error is not None:
            raise mine.error
        return SampleResult(mine.result, self.prompt_logprobs(snap, prompt) if prompt_logprobs
                            else None)

    def prompt_alternatives(self, snap: Any, prompt: list[int], k: int
                            ) -> list[list[tuple[int, float]] | None]:
        """The `k` most likely tokens at each prompt position under `snap`, at temperature
        1 (the distribution `prompt_logprobs` scores the prompt by), most likely first; None
        at position 0, which nothing predicts."""
        import torch

        if len(prompt) < 2:
            return [None] * len(prompt)
        with self.model.lock, torch.no_grad():
            self.model.activate(snap or self._sampler.adapter)
            net = self.model.net
            net.eval()
            ids = torch.tensor([prompt[:-1]], device=self.model.device)
            lp = torch.log_softmax(net(input_ids=ids).logits[0].float(), dim=-1)
            values, tokens = lp.topk(min(k, lp.shape[-1]), dim=-1)
        return [None, *(list(zip(t, v, strict=True)) for t, v in
                         zip(tokens.tolist(), values.tolist(), strict=True))]

    def prompt_logprobs(self, snap: Any, prompt: list[int]) -> list[float]:
        """log p(prompt[i] | prompt[:i]) under `snap` at temperature 1; NaN for the first."""
        if len(prompt) < 2:
            return [math.nan] * len(prompt)
        datum = Datum(input_tokens=prompt[:-1], target_tokens=prompt[1:],
                      logprobs=[0.0] * (len(prompt) - 1), advantages=[0.0] * (len(prompt) - 1),
                      mask=[1.0] * (len(prompt) - 1))
        [lps] = self._sampler.logprobs([datum], adapter=snap or self._sampler.adapter)
        return [math.nan, *lps]

    def _decode(self, part: list[_Queued], snap: Any, n: int, params: SamplingParams) -> None:
        batch = [q for q in part if not q.cancelled]
        for q in part:
            if q.cancelled:
                q.error = SamplingStopped("sampling cancelled before it began")
        if not batch:
            return
        # Seeds go per prompt (prompt_seeds), so the batch-wide seed stays unset.
        seeds = None
        if any(q.seed is not None for q in batch):
            seeds = tuple(int(self._seeds.integers(2**63)) if q.seed is None else q.seed
                          for q in batch)
        common = SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature,
                                top_p=params.top_p, stop_tokens=params.stop_tokens,
                                stop_strings=params.stop_strings,
                                top_logprobs=params.top_logprobs, prompt_seeds=seeds)
        try:
            groups = self._sampler.sample(
                [q.prompt for q in batch], n, common, adapter=snap or self._sampler.adapter,
                on_token=_tell(batch, n), leave=_gone(batch, n))
        except BaseException as exc:
            if isinstance(exc, SamplingStopped):  # its traceback's frames hold the KV cache
                exc = exc.with_traceback(None)
            for q in batch:
                q.error = exc
            return
        for q, group in zip(batch, groups, strict=True):
            if q.cancelled:  # it left the batch part-way: nobody reads its completions
                q.error = SamplingStopped("sampling cancelled: its client is gone")
            else:
                q.result = group


@dataclass
class _Queued:
    """A sample request waiting for the model; the batch that serves it fills `result`."""

    prompt: list[int]
    seed: int | None
    on_token: OnToken | None = None
    cancel: threading.Event | None = None   # set once its client is gone
    result: list | None = None
    error: BaseException | None = None

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()


def _tell(batch: list[_Queued], n: int) -> OnToken | None:
    """The batch's token hook: row r is sample r % n of request r // n."""
    if all(q.on_token is None for q in batch):
        return None

    def on_token(row: int, token: int, logprob: float, top) -> None:
        q = batch[row // n]
        if q.on_token is not None:
            try:
                q.on_token(row % n, token, logprob, top)
            except Exception:  # one listener's failure must not stop the others' decode
                log.exception("a token listener failed; it hears no more")
                q.on_token = None
    return on_token


def _give_memory_back() -> None:
    """Hand the heap's free pages back to the OS: glibc keeps them after a large batch's KV
    cache is freed, and the server's RSS would stay gigabytes high for good."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _gone(batch: list[_Queued], n: int) -> Callable[[], list[int]]:
    """The batch's `leave`: the rows of every request cancelled so far (row r is sample
    r % n of request r // n), which leave the decode at its next step."""
    def gone() -> list[int]:
        return [k * n + j for k, q in enumerate(batch) if q.cancelled for j in range(n)]
    return gone


def _by_length(batch: list[_Queued]) -> list[list[_Queued]]:
    """The batch as decoded: whole when nothing in it is seeded, else one part per prompt
    length (no padding: a seeded prompt's numbers are those of its own decode)."""
    if all(q.seed is None for q in batch):
        return [batch]
    parts: dict[int, list[_Queued]] = {}
    for q in batch:
        parts.setdefault(len(q.prompt), []).append(q)
    return list(parts.values())


def _loss_config(loss_fn: str, config: dict[str, float]) -> LossConfig:
    """A request's loss: Tinker's absolute clip bounds (each loss's documented default where
    absent) as the local backend's clip_eps, Tinker's sum as the aggregation."""
    lo, hi = losses.DEFAULT_THRESHOLDS.get(loss_fn, (0.8, 1.2))
    return LossConfig(name=loss_fn, clip_eps=1.0 - config.get("clip_low_threshold", lo),
                      clip_eps_high=config.get("clip_high_threshold", hi) - 1.0,
                      dro_beta=config.get("beta", losses.DEFAULT_DRO_BETA),
                      aggregation=aggregation.SUM, temperature=config.get("temperature", 1.0))


def _local_datum(d: Datum, loss_fn: str) -> Datum:
    """Every position trained (mask 1); for `cross_entropy` the advantages are the client's
    token weights."""
    weights = d.weights if loss_fn == "cross_entropy" else d.advantages
    return dataclasses.replace(d, advantages=list(weights or [0.0] * len(d)),
                               mask=[1.0] * len(d))


def _forward_only(backend: LocalBackend, data: list[Datum], loss: LossConfig) -> LossOutput:
    """A forward pass without gradient: target log-probs and the Tinker loss (a sum)."""
    import torch

    from retrain.backends.local.training.policy_losses import token_losses

    def tensor(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32)

    local = [_local_datum(d, loss.name) for d in data]
    logprobs = backend.logprobs(local, loss.temperature)
    total = 0.0
    for d, lp in zip(local, logprobs, strict=True):
        in_ratio = torch.tensor([m != 0 for m in d.ratio_mask or d.mask])
        total += float(token_losses(tensor(lp), tensor(d.logprobs), tensor(d.advantages), loss,
                                    in_ratio=in_ratio).loss.sum())
    return LossOutput(total, [np.asarray(lp, dtype=np.float32) for lp in logprobs])

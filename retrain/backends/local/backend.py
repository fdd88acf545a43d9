"""The local backend: torch + transformers + peft, in process.

Two objects, so that several trainers can share one base model (e.g. `retrain serve`):
- `LocalModel` (model.py): the base model and tokenizer, loaded once, wrapped by peft
  with named adapters.
- `LocalBackend`: one LoRA adapter of a `LocalModel` with its own AdamW optimizer and RNG. It
  activates its adapter before every operation, under the model's lock. `full.FullBackend`
  trains every weight of a model of its own instead (`model.finetune = "full"`).

Log-prob semantics (sampler and trainer agree): float32 `log_softmax(logits / temperature)`;
see `sampling.exact` for top_p and `training/` for the training pass: `plan` (micro-batches
from the device's free memory), `pack` and `forward` (the prefix and packed layouts),
`logprobs` (the LM head in chunks), `accumulate` (the loop, statistics on the device).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from retrain.algorithms.aggregation import Normaliser
from retrain.backends.base import (
    AdamParams,
    BackendError,
    BackendOOMError,
    Completion,
    Datum,
    DivergedError,
    LossConfig,
    LossOutput,
    OptimOutput,
    SamplingParams,
    TokenIds,
    TokenUsage,
    finished,
)
from retrain.backends.local import checkpoint, lora
from retrain.backends.local.device import oom_as_backend_error
from retrain.backends.local.model import LocalModel
from retrain.backends.local.sampling import compiled
from retrain.backends.local.sampling.exact import OnToken, sample_batch
from retrain.backends.local.training import accumulate, plan
from retrain.backends.local.training.forward import Forward, layout_for
from retrain.backends.local.training.logprobs import Head
from retrain.backends.local.training.pack import BUCKET_OVERHEAD
from retrain.control.stepcost import ModelCost

if TYPE_CHECKING:
    from retrain.config.sections import BackendConfig, ModelConfig, TrainingConfig

class LocalBackend:
    """One LoRA adapter of a LocalModel, with its AdamW optimizer and sampling RNG."""

    rate_limit_wait_s = 0.0  # nothing to wait for in process

    def __init__(self, model: LocalModel, adapter: str, *, micro_batch_size: int = 0,
                 seed: int = 0, checkpoint_dir: str | Path | None = None):
        self.model = model
        self.adapter = adapter
        self.micro_batch_size = micro_batch_size
        self.bucket_overhead = BUCKET_OVERHEAD
        self.layout = layout_for(model.device)  # training/forward.py: prefix or packed rows
        self.compile_training = False  # torch.compile of the packed forward (bench/gpu/main.py)
        self._token_bytes: int | None = None  # saved activations per token (CUDA plans)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.params = self._trainable()
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=1e-4)
        self.generator = torch.Generator(model.device).manual_seed(seed)
        self._snapshots = 0
        self._cost: ModelCost | None = None
        self._loss_finite = True  # the gradient waiting for optim_step came from a finite loss
        self.fast_ratio_cap = 0.0  # [backend] fast_ratio_cap, applied while sampling is fast
        self.token_usage = TokenUsage()

    def _trainable(self) -> dict[str, torch.nn.Parameter]:
        """The weights AdamW updates, by name in a stable order: this adapter's."""
        return self.model.adapter_params(self.adapter)

    @classmethod
    def new_adapter(cls, model: LocalModel, adapter_name: str, lora_rank: int = 8,
                    lora_alpha: float = 16.0, lora_dropout: float = 0.0,
                    target_modules: list[str] | None = None, seed: int = 0,
                    micro_batch_size: int = 0,
                    checkpoint_dir: str | Path | None = None) -> LocalBackend:
        """A trainer for a fresh adapter on `model` (empty targets = peft's per-architecture
        default, e.g. q_proj/v_proj for Llama-like models)."""
        config = lora.lora_config(lora_rank, lora_alpha, lora_dropout, target_modules)
        try:
            model.add_adapter(adapter_name, config, seed)
        except ValueError as exc:  # peft: no default targets for this architecture, bad names
            raise BackendError(f"cannot add LoRA to {model.name_or_path}: {exc}; set "
                               "model.lora_target_modules") from exc
        return cls(model, adapter_name, micro_batch_size=micro_batch_size, seed=seed,
                            checkpoint_dir=checkpoint_dir)

    @classmethod
    def from_config(cls, model: ModelConfig, training: TrainingConfig, backend: BackendConfig,
                    config_dir: Path | None = None,
                    checkpoint_dir: Path | None = None) -> LocalBackend:
        """A private LocalModel with one adapter, from `[model]` and `[training]` (and
        `[backend]` compile, sampler, fast_ratio_cap)."""
        loaded = LocalModel.from_config(model, training, config_dir)
        lora.check_target_modules(loaded.base, model.lora_target_modules, model.name)
        built = LocalBackend.new_adapter(loaded, "default", model.lora_rank, model.lora_alpha,
                                         model.lora_dropout, model.lora_target_modules,
                                         seed=training.seed,
                                         micro_batch_size=training.micro_batch_size,
                                         checkpoint_dir=checkpoint_dir)
        if compiled.wanted(backend.compile):
            loaded.compile_decoding()
        loaded.use_sampler(backend.sampler)
        built.fast_ratio_cap = backend.fast_ratio_cap
        return built

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def max_context(self) -> int | None:
        """Prompt + completion tokens the model takes (its positions)."""
        return self.model.max_context

    @property
    def summary(self) -> str:
        """Model, device, dtype and threads, as the run log shows them."""
        return self.model.summary

    @property
    def cost_model(self) -> ModelCost:
        """What the trainer's FLOPs and bytes estimates need (retrain.control.stepcost)."""
        if self._cost is None:
            self._cost = self.model.cost_model()
        return self._cost

    # ------------------------------------------------------------------ sampling

    def sample_async(self, prompts: list[TokenIds], n: int,
                     params: SamplingParams) -> Future[list[list[Completion]]]:
        """Sampling shares the device with training here, so it runs now, to the end."""
        return finished(self.sample, prompts, n, params)

    def sample(self, prompts: list[TokenIds], n: int, params: SamplingParams,
               adapter: str | None = None,
               on_token: OnToken | None = None, stop: Callable[[], bool] | None = None,
               leave: Callable[[], Collection[int]] | None = None) -> list[list[Completion]]:
        """`n` completions per prompt in one batched decode; `adapter` picks a snapshot.

        `params.prompt_seeds` (one per prompt) makes each prompt's draws its own, independent
        of the rest of the batch (serve's requests, the trainer's groups); else `params.seed`.
        `on_token` hears of each token as it is drawn (see `sample_batch`); `stop`, asked
        between decoding steps, ends the decode early (SamplingStopped); `leave`, asked there
        too, names completions that leave the batch as they are."""
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise BackendError("cannot sample from an empty prompt")
        seeds = params.prompt_seeds
        if seeds is not None and len(seeds) != len(prompts):
            raise BackendError(f"sampling: {len(seeds)} prompt seeds for {len(prompts)} prompts")
        self._fit_threads()
        if self.model.fast is not None:
            out = self._sample_fast(prompts, n, params, adapter, seeds)
        else:
            out = self._sample_exact(prompts, n, params, adapter, seeds, on_token, stop, leave)
        self.token_usage.count_sample(prompts, out)
        return out

    def _sample_exact(self, prompts: list[TokenIds], n: int, params: SamplingParams,
                      adapter: str | None, prompt_seeds: tuple[int, ...] | None,
                      on_token: OnToken | None, stop: Callable[[], bool] | None,
                      leave: Callable[[], Collection[int]] | None) -> list[list[Completion]]:
        """`sample` through the exact sampler (sampling/exact.py)."""
        dev = self.model.device
        gen: torch.Generator | list[torch.Generator] = self.generator
        if prompt_seeds is not None:
            gen = [torch.Generator(dev).manual_seed(s) for s in prompt_seeds]
        elif params.seed is not None:
            gen = torch.Generator(dev).manual_seed(params.seed)
        with self.model.lock, oom_as_backend_error("sampling"):
            self.model.activate(adapter or self.adapter)
            net = self.model.net
            net.eval()
            return sample_batch(net, prompts, n, params, eos_ids=self.model.eos_ids,
                                pad_id=self.model.pad_id, generator=gen,
                                make_cache=self._make_cache, cache_key=self.model.cache_key,
                                decode=self.model.tokenizer.decode, decoder=self.model.decoder,
                                on_token=on_token, stop=stop, leave=leave,
                                window=self.model.exact_window)

    def _sample_fast(self, prompts: list[TokenIds], n: int, params: SamplingParams,
                     adapter: str | None, prompt_seeds: tuple[int, ...] | None
                     ) -> list[list[Completion]]:
        """`sample` through the fast sampler: counter draws keyed by (seed, prompt, sample)
        (prompt_seeds: each prompt its own seed; else one seed, from params.seed or drawn
        from the backend's generator, and the prompt's place in the batch)."""
        if prompt_seeds is not None:
            seeds, prompt_ids = list(prompt_seeds), [0] * len(prompts)
        else:
            seed = params.seed if params.seed is not None else int(torch.randint(
                0, 2**62, (1,), generator=self.generator, device=self.model.device))
            seeds, prompt_ids = [seed] * len(prompts), list(range(len(prompts)))
        with self.model.lock, oom_as_backend_error("sampling"):
            name = adapter or self.adapter
            self.model.activate(name)
            net = self.model.net
            net.eval()
            return self.model.fast.sample(
                net, name, prompts, n, params, seeds=seeds, prompt_ids=prompt_ids,
                eos_ids=self.model.eos_ids, pad_id=self.model.pad_id,
                make_cache=self._make_cache, cache_key=self.model.cache_key,
                decode=self.model.tokenizer.decode)

    def _make_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.base.config)

    def snapshot(self, name: str | None = None) -> str:
        """Freeze a copy of the current adapter weights as a new adapter to sample from."""
        with self.model.lock:
            self._snapshots += 1
            name = name or f"{self.adapter}-snapshot{self._snapshots}"
            self.model.add_adapter(name, self.model.lora_configs[self.adapter], seed=0)
            target = self.model.adapter_params(name)
            with torch.no_grad():
                for (_, src), (_, dst) in zip(self.params.items(), target.items(), strict=True):
                    dst.copy_(src)
                    dst.requires_grad_(False)
            self.model.activate(self.adapter)
            return name

    # ------------------------------------------------------------------ training

    def forward_backward(self, datums: list[Datum], loss: LossConfig,
                         norm: Normaliser | None = None, total_tokens: int = 0) -> LossOutput:
        """Accumulate the policy-loss gradient over `datums`, normalised as `loss.aggregation`
        says (algorithms/aggregation.py) over the whole call (`norm`, `total_tokens`: over
        the whole call of which these datums are one rank's share, retrain/distributed).

        With `micro_batch_size = 0` the micro-batches fit the device's free memory
        (training/plan.py) and an out-of-memory error halves the largest and retries; only a
        single sequence that does not fit raises BackendOOMError.
        """
        size = self.micro_batch_size
        while True:
            try:
                with self.model.lock, oom_as_backend_error("forward_backward"):
                    out = self._forward_backward(datums, loss, size, norm, total_tokens)
                    self._loss_finite = self._loss_finite and math.isfinite(out.loss)
                    self.token_usage.count(trained=sum(map(len, datums)))
                    return out
            except BackendOOMError:
                self._zero_grad()
                largest = max((len(u.index) for u in self._plan(datums, size)), default=1)
                if self.micro_batch_size > 0 or largest <= 1:
                    raise
                size = largest // 2

    def _forward(self, net: Any) -> Forward:
        """How micro-batches run through `net` in this backend's layout."""
        packed = self.layout == "packed"
        return Forward(Head(net, compile=self.compile_training and packed), self.layout,
                       self.model.cache_key, self._make_cache, self.bucket_overhead)

    def _plan(self, datums: list[Datum], size: int, net: Any = None) -> list[plan.Unit]:
        """Micro-batches of `size` sequences, or (0) within the device's budget."""
        head = Head(net if net is not None else self.model.net)
        return plan.plan(datums, size, self._budget(head), self.model.vocab_size,
                         packed=self.layout == "packed")

    def _budget(self, head: Head) -> plan.Budget:
        """The CPU's budgets; on CUDA what its free memory holds (training/plan.py)."""
        dev = self.model.device
        if dev.type != "cuda":
            return plan.cpu_budget()
        if self._token_bytes is None:
            self._token_bytes = plan.saved_bytes_per_token(head.body or head.net, dev)
        pending = sum(p.numel() * p.element_size() for p in self.params.values()
                      if p.grad is None)
        return plan.memory_budget(plan.free_bytes(dev, pending), self._token_bytes,
                                  head.chunked)

    def _forward_backward(self, datums: list[Datum], loss: LossConfig, size: int,
                          norm: Normaliser | None = None, total_tokens: int = 0) -> LossOutput:
        self.model.activate(self.adapter)
        net = self.model.net
        net.train()
        if self.model.fast is not None and self.fast_ratio_cap:
            loss = replace(loss, ratio_cap=self.fast_ratio_cap)
        trainee = accumulate.Trainee(list(self.params.values()), self.model.pad_id,
                                     self.model.device, self.generator)
        return accumulate.forward_backward(self._forward(net), trainee, datums, loss,
                                           self._plan(datums, size, net), norm, total_tokens)

    def logprobs(self, datums: list[Datum], temperature: float = 1.0,
                 adapter: str | None = None) -> list[list[float]]:
        """Target log-probs of the masked positions, no gradient (0.0 elsewhere); `adapter`
        picks a snapshot. For forward-only passes and prompt log-probs in `retrain serve`."""
        with self.model.lock:
            self.model.activate(adapter or self.adapter)
            return self._forward_logprobs(self.model.net, datums, temperature)

    def _forward_logprobs(self, net: Any, datums: list[Datum],
                          temperature: float) -> list[list[float]]:
        out_lp: list[list[float]] = [[0.0] * len(d.target_tokens) for d in datums]
        with self.model.lock, oom_as_backend_error("forward"), torch.no_grad():
            net.eval()
            forward = self._forward(net)
            batches = [forward.pack(datums, unit, self.model.pad_id, self.model.device)
                       for unit in self._plan(datums, self.micro_batch_size, net)]
            lps = [forward.logprobs(batch, temperature) for batch in batches]
            accumulate.write_logprobs(out_lp, [w for b in batches for w in b.t.where], lps)
        return out_lp

    def reference_logprobs(self, datums: list[Datum],
                           temperature: float = 1.0) -> list[list[float]]:
        """The base model's log-probs: the same forward with the adapter disabled (peft's
        `disable_adapter`), so no second copy of the model is held."""
        with self.model.lock:
            self.model.activate(self.adapter)
            with self.model.net.disable_adapter():
                out = self.logprobs(datums, temperature)
        self.token_usage.count(prefill=sum(map(len, datums)))
        return out

    def optim_step(self, adam: AdamParams) -> OptimOutput:
        """One AdamW step on this adapter's parameters; returns the pre-clip gradient norm.

        A non-finite loss or gradient skips the update (metrics `skipped` and
        `skipped_nonfinite` = 1) instead of poisoning the weights and the optimizer state. An
        update that leaves non-finite weights is undone and raises DivergedError. With
        automatic CPU threads, the threads are fitted to what other processes used since the
        last check (metrics `cpu_threads`, `others_busy_cores`; sampling checks too).
        """
        out = self._optim_step(adam)
        out.metrics.update(self._fit_threads())
        return out

    def _fit_threads(self) -> dict[str, float]:
        """Automatic CPU threads fitted to what other processes used lately (threads.py)."""
        auto = self.model.cpu_threads
        if auto is None:
            return {}
        with self.model.lock:
            auto.check()
            return auto.metrics()

    def thread_metrics(self) -> dict[str, float]:
        """The automatic threads as last fitted (the step's sampling fitted them); {} when the
        user set `[model] threads` or the model runs on a GPU."""
        auto = self.model.cpu_threads
        return {} if auto is None else auto.metrics()

    def _optim_step(self, adam: AdamParams) -> OptimOutput:
        with self.model.lock:
            loss_finite, self._loss_finite = self._loss_finite, True
            params = [p for p in self.params.values() if p.grad is not None]
            if not params:
                return OptimOutput(grad_norm=0.0, metrics={"skipped": 1.0,
                                                           "skipped_nonfinite": 0.0})
            clip = adam.grad_clip_norm if adam.grad_clip_norm > 0 else float("inf")
            norm = self._clip(params, clip)
            if not (math.isfinite(norm) and loss_finite):
                self._zero_grad()
                return OptimOutput(grad_norm=norm, metrics={"skipped": 1.0,
                                                            "skipped_nonfinite": 1.0})
            for group in self.optimizer.param_groups:
                group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2),
                             eps=adam.eps, weight_decay=adam.weight_decay)
            before = [p.detach().clone() for p in params]
            self.optimizer.step()
            self._zero_grad()
            if not self._finite(params):
                with torch.no_grad():  # put the last finite weights back
                    for p, old in zip(params, before, strict=True):
                        p.copy_(old)
                raise DivergedError("the AdamW update made the trained weights non-finite "
                                    "(overflow); lower training.lr or training.weight_decay")
            self._stepped()
            return OptimOutput(grad_norm=norm, metrics={"skipped": 0.0,
                                                        "skipped_nonfinite": 0.0})

    # Where a sharded backend (retrain/distributed/fsdp.py) differs in the step:
    def _clip(self, params: list[torch.nn.Parameter], clip: float) -> float:
        """Clip the gradients to `clip`; their norm before."""
        return float(torch.nn.utils.clip_grad_norm_(params, clip))

    def _finite(self, params: list[torch.nn.Parameter]) -> bool:
        """Whether the updated weights are finite."""
        return checkpoint.all_finite(params)

    def _stepped(self) -> None:
        """After an update that was kept."""

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ checkpoints

    def save_state(self, name: str) -> str:
        """Write `<checkpoint_dir>/<name>/`: a peft adapter folder + optimizer + RNG state."""
        if self.checkpoint_dir is None:
            raise BackendError("save_state needs checkpoint_dir (set by the trainer)")
        return checkpoint.save_state(self.checkpoint_dir / name, self.model, self.adapter,
                                           self.optimizer, self.generator)

    def save_state_async(self, name: str) -> Future[str]:
        """`save_state`, done now: a local save has no round trip to hide."""
        return finished(self.save_state, name)

    def load_state(self, ref: str) -> None:
        """Restore adapter weights, optimizer and RNG from a `save_state` folder; a missing or
        damaged one is a BackendError (the trainer then falls back to an older one)."""
        checkpoint.load_state(ref, self.checkpoint_dir, self.model, self.adapter,
                                    self.optimizer, self.generator)

    def close(self) -> None:
        """Drop the optimizer state; the model stays loaded for other adapters."""
        self.optimizer.state.clear()

"""The local backend: torch + transformers + peft, in process.

Two objects, so that several trainers can share one base model (e.g. `retrain serve`):
- `LocalModel` (model.py): the base model and tokenizer, loaded once, wrapped by peft
  with named adapters.
- `LocalBackend`: one LoRA adapter of a `LocalModel` with its own AdamW optimizer and RNG. It
  activates its adapter before every operation, under the model's lock. `full.FullBackend`
  trains every weight of a model of its own instead (`model.finetune = "full"`).

Log-prob semantics (sampler and trainer agree): float32 `log_softmax(logits / temperature)`;
see `sampling.exact` for top_p and `training.micro_batches` for the token aggregation.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from retrain.algorithms import aggregation
from retrain.algorithms.kl import token_kl
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
    finished,
)
from retrain.backends.local import checkpoint, lora
from retrain.backends.local.device import oom_as_backend_error
from retrain.backends.local.model import LocalModel
from retrain.backends.local.sampling import compiled
from retrain.backends.local.sampling.exact import OnToken, sample_batch, token_logprobs
from retrain.backends.local.training import micro_batches, policy_losses
from retrain.control.stepcost import ModelCost

if TYPE_CHECKING:
    from retrain.config.sections import Config

@contextmanager
def _seeded_dropout(generator: torch.Generator, device: torch.device) -> Iterator[None]:
    """LoRA dropout draws from the global RNG: seed it from the backend's own generator
    (saved with checkpoints) so that training resumes exactly, and restore it afterwards."""
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=device))
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


class LocalBackend:
    """One LoRA adapter of a LocalModel, with its AdamW optimizer and sampling RNG."""

    rate_limit_wait_s = 0.0  # nothing to wait for in process

    def __init__(self, model: LocalModel, adapter: str, *, micro_batch_size: int = 0,
                 seed: int = 0, checkpoint_dir: str | Path | None = None):
        self.model = model
        self.adapter = adapter
        self.micro_batch_size = micro_batch_size
        self.bucket_overhead = micro_batches.BUCKET_OVERHEAD
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.params = self._trainable()
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=1e-4)
        self.generator = torch.Generator(model.device).manual_seed(seed)
        self._snapshots = 0
        self._cost: ModelCost | None = None
        self._loss_finite = True  # the gradient waiting for optim_step came from a finite loss
        self.fast_ratio_cap = 0.0  # [backend] fast_ratio_cap, applied while sampling is fast

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
    def from_config(cls, cfg: Config, config_dir: Path | None = None,
                    checkpoint_dir: Path | None = None) -> LocalBackend:
        """A private LocalModel with one adapter, from `[model]` and `[training]` (and
        `[backend] compile`)."""
        m = cfg.model
        model = LocalModel.from_config(cfg, config_dir)
        lora.check_target_modules(model.base, m.lora_target_modules, m.name)
        backend = LocalBackend.new_adapter(model, "default", m.lora_rank, m.lora_alpha,
                                           m.lora_dropout, m.lora_target_modules,
                                           seed=cfg.training.seed,
                                           micro_batch_size=cfg.training.micro_batch_size,
                                           checkpoint_dir=checkpoint_dir)
        if compiled.wanted(cfg.backend.compile):
            model.compile_decoding()
        model.use_sampler(cfg.backend.sampler)
        backend.fast_ratio_cap = cfg.backend.fast_ratio_cap
        return backend

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
               adapter: str | None = None, prompt_seeds: list[int] | None = None,
               on_token: OnToken | None = None, stop: Callable[[], bool] | None = None,
               leave: Callable[[], Collection[int]] | None = None) -> list[list[Completion]]:
        """`n` completions per prompt in one batched decode; `adapter` picks a snapshot.

        `prompt_seeds` (one per prompt) makes each prompt's draws its own, independent of the
        rest of the batch (retrain serve batches separate requests); else `params.seed`.
        `on_token` hears of each token as it is drawn (see `sample_batch`); `stop`, asked
        between decoding steps, ends the decode early (SamplingStopped); `leave`, asked there
        too, names completions that leave the batch as they are."""
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise BackendError("cannot sample from an empty prompt")
        if self.model.fast is not None:
            return self._sample_fast(prompts, n, params, adapter, prompt_seeds)
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
                     adapter: str | None, prompt_seeds: list[int] | None
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

    def forward_backward(self, datums: list[Datum], loss: LossConfig) -> LossOutput:
        """Accumulate the policy-loss gradient over `datums`, normalised as `loss.aggregation`
        says (algorithms/aggregation.py) over the whole call.

        With `micro_batch_size = 0` an out-of-memory error halves the micro-batch and retries;
        only a single sequence that does not fit raises BackendOOMError.
        """
        size = self.micro_batch_size
        while True:
            try:
                with self.model.lock, oom_as_backend_error("forward_backward"):
                    out = self._forward_backward(datums, loss, size)
                    self._loss_finite = self._loss_finite and math.isfinite(out.loss)
                    return out
            except BackendOOMError:
                self._zero_grad()
                largest = max((len(u.index) for u in self._plan(datums, size)), default=1)
                if self.micro_batch_size > 0 or largest <= 1:
                    raise
                size = largest // 2

    def _plan(self, datums: list[Datum], size: int) -> list[micro_batches.Unit]:
        return micro_batches.plan(datums, size, self.model.vocab_size)

    def _forward_backward(self, datums: list[Datum], loss: LossConfig, size: int) -> LossOutput:
        self.model.activate(self.adapter)
        net = self.model.net
        net.train()
        tokens = [sum(1 for m in d.mask if m > 0) for d in datums]
        total_tokens = sum(tokens)
        if self.model.fast is not None and self.fast_ratio_cap:
            loss = replace(loss, ratio_cap=self.fast_ratio_cap)
        out_lp: list[list[float]] = [[0.0] * len(d.target_tokens) for d in datums]
        if total_tokens == 0:
            return LossOutput(loss=0.0, logprobs=out_lp, metrics={"tokens": 0.0})
        norm = aggregation.normaliser(tokens, loss.aggregation, loss.max_tokens)
        loss_sum, ratios, kl_sum = 0.0, policy_losses.RatioStats(), 0.0
        units = self._plan(datums, size)
        grads = micro_batches.GradDiagnostics(list(self.params.values()), total_tokens, len(units))
        diagnostics_s = 0.0
        with _seeded_dropout(self.generator, self.model.device):
            for unit in units:
                batch = micro_batches.pack(datums, unit, self.model.pad_id, self.model.device,
                                        norm.weights)
                lp = self._target_logprobs(net, batch, loss.temperature)
                terms = policy_losses.token_losses(lp, batch.old_logprobs, batch.advantages,
                                                   loss, batch.seq, batch.in_ratio)
                per_tok = terms.loss
                if loss.kl_coef:
                    kl = token_kl(lp, self._ref(datums, batch), loss.kl_estimator)
                    per_tok = per_tok + loss.kl_coef * kl
                    kl_sum += float(kl.detach().sum())
                chunk_loss = (per_tok * batch.weights).sum() / norm.denominator
                chunk_loss.backward()
                t0 = time.perf_counter()
                grads.after_micro_batch(int(batch.targets.numel()))
                diagnostics_s += time.perf_counter() - t0
                loss_sum += float(chunk_loss.detach())
                ratios.add(terms)
                for (i, pos), value in zip(batch.where, lp.detach().cpu().tolist(),
                                           strict=True):
                    out_lp[i][pos] = value
        metrics = {"tokens": float(total_tokens), **grads.metrics(),
                   "grad_diagnostics_s": diagnostics_s, **ratios.metrics()}
        if loss.kl_coef:
            metrics["kl"] = kl_sum / total_tokens
        return LossOutput(loss=loss_sum, logprobs=out_lp, metrics=metrics)

    def _ref(self, datums: list[Datum], batch: micro_batches.Packed) -> torch.Tensor:
        """The reference log-probs of `batch`'s targets, in their order."""
        missing = [i for i, _ in batch.where if datums[i].ref_logprobs is None]
        if missing:
            raise BackendError(f"datum {missing[0]} has no ref_logprobs for the KL term")
        return torch.tensor([datums[i].ref_logprobs[pos] for i, pos in batch.where],
                            dtype=torch.float32, device=self.model.device)

    def _target_logprobs(self, net: Any, batch: micro_batches.Packed,
                         temperature: float) -> torch.Tensor:
        """Log-probs of the kept targets, in `batch.targets` order: prefixes once, suffixes in
        length buckets on their rows of the prefix KV cache. Only kept positions reach the LM
        head."""
        prefix = None if batch.prefix_ids is None else self._prefix_kv(net, batch)
        lengths = batch.suffix_mask.sum(-1).tolist()
        entry = (batch.keep.flatten().cumsum(0) - 1).view_as(batch.keep)  # index in targets
        parts, order = [], []
        for run in micro_batches.length_buckets(lengths, self.bucket_overhead):
            rows = torch.tensor(run, device=batch.input_ids.device)
            width = max(lengths[r] for r in run)
            keep = batch.keep[rows, :width]
            args: dict[str, Any] = {}  # right padding alone needs no attention mask
            if prefix is not None:
                prows = batch.row_prefix[rows]
                cache = self._make_cache()
                for layer, (k, v) in enumerate(prefix):
                    cache.update(k[prows], v[prows], layer)
                args = {"attention_mask": torch.cat([batch.prefix_mask[prows],
                                                     batch.suffix_mask[rows, :width]], dim=1),
                        "position_ids": batch.positions[rows, :width],
                        self.model.cache_key: cache, "use_cache": True}
            logits = net(input_ids=batch.input_ids[rows, :width], logits_to_keep=keep,
                         **args).logits
            parts.append(token_logprobs(logits, temperature))
            order.append(entry[rows, :width][keep])
        where = torch.cat(order)
        lp = torch.cat(parts).gather(-1, batch.targets[where][:, None]).squeeze(-1)
        return lp[torch.argsort(where)]

    def _prefix_kv(self, net: Any, batch: micro_batches.Packed) -> list[tuple[Any, Any]]:
        """Each layer's keys and values of the distinct prefixes (with gradients in training)."""
        cache = self._make_cache()
        positions = (batch.prefix_mask.cumsum(-1) - 1).clamp(min=0)
        net(input_ids=batch.prefix_ids, attention_mask=batch.prefix_mask,
            position_ids=positions, **{self.model.cache_key: cache}, use_cache=True,
            logits_to_keep=1)
        return [(layer.keys, layer.values) for layer in cache.layers]

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
            for unit in self._plan(datums, self.micro_batch_size):
                batch = micro_batches.pack(datums, unit, self.model.pad_id, self.model.device)
                lp = self._target_logprobs(net, batch, temperature)
                for (i, pos), value in zip(batch.where, lp.cpu().tolist(), strict=True):
                    out_lp[i][pos] = value
        return out_lp

    def reference_logprobs(self, datums: list[Datum],
                           temperature: float = 1.0) -> list[list[float]]:
        """The base model's log-probs: the same forward with the adapter disabled (peft's
        `disable_adapter`), so no second copy of the model is held."""
        with self.model.lock:
            self.model.activate(self.adapter)
            with self.model.net.disable_adapter():
                return self.logprobs(datums, temperature)

    def optim_step(self, adam: AdamParams) -> OptimOutput:
        """One AdamW step on this adapter's parameters; returns the pre-clip gradient norm.

        A non-finite loss or gradient skips the update (metrics `skipped` and
        `skipped_nonfinite` = 1) instead of poisoning the weights and the optimizer state. An
        update that leaves non-finite weights is undone and raises DivergedError.
        """
        with self.model.lock:
            loss_finite, self._loss_finite = self._loss_finite, True
            params = [p for p in self.params.values() if p.grad is not None]
            if not params:
                return OptimOutput(grad_norm=0.0, metrics={"skipped": 1.0,
                                                           "skipped_nonfinite": 0.0})
            clip = adam.grad_clip_norm if adam.grad_clip_norm > 0 else float("inf")
            norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
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
            if not checkpoint.all_finite(params):
                with torch.no_grad():  # put the last finite weights back
                    for p, old in zip(params, before, strict=True):
                        p.copy_(old)
                raise DivergedError("the AdamW update made the trained weights non-finite "
                                    "(overflow); lower training.lr or training.weight_decay")
            return OptimOutput(grad_norm=norm, metrics={"skipped": 0.0,
                                                        "skipped_nonfinite": 0.0})

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

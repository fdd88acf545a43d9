"""The Backend contract: the primitives hosted training APIs expose, and their datatypes.

The trainer drives any backend through these calls; local (torch) and remote (Tinker)
backends are interchangeable. Nothing here imports torch or an SDK.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from retrain.algorithms import losses
from retrain.algorithms.losses import DEFAULT_DRO_BETA
from retrain.control.stepcost import ModelCost

T = TypeVar("T")

TokenIds = list[int]


@dataclass
class SamplingParams:
    """How to sample. Log-probs are returned under this same temperature.

    `top_k` (-1 = off), `stop_tokens` and `stop_strings` come from Tinker clients through
    `retrain serve`: a completion ends at EOS, at a stop token, or with the token that
    completes a stop string (matched on the decoded text), whichever comes first.
    `top_logprobs` (OpenAI clients of `retrain serve`): the k most likely tokens to report
    at each sampled position, under the same distribution as `logprobs` (0 = none).
    `prompt_seeds` (one per prompt of the call) keys each prompt's draws by its own seed, not
    by its place in the batch: the trainer's are derived from (seed, step, group), so any
    split of a step's groups across calls or ranks samples the same completions.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = -1
    stop_tokens: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    top_logprobs: int = 0
    prompt_seeds: tuple[int, ...] | None = None


@dataclass
class Completion:
    """One sampled continuation: tokens up to and including EOS, nothing after."""

    tokens: TokenIds
    logprobs: list[float]          # log-prob of each sampled token under the sampling distribution
    finish_reason: str             # "stop" (hit EOS) | "length" (hit max_tokens)
    # (token, log-prob) of the k most likely tokens at each position, when params asked
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class Datum:
    """One training sequence, already shifted for next-token prediction.

    `input_tokens[i]` predicts `target_tokens[i]`; `logprobs`, `advantages` and `mask` are
    aligned to the targets. Prompt positions have mask 0 and advantage 0. `weights` (aligned
    too) are the per-token weights of a supervised `cross_entropy` loss; None otherwise.
    `ref_logprobs` (aligned too): the reference model's log-probs, for a KL term in the loss.
    `ratio_mask` marks the targets whose log-ratios make gspo's sequence ratio (Tinker's
    `sequence_ratio_mask`); None: the targets `mask` marks.
    """

    input_tokens: TokenIds
    target_tokens: TokenIds
    logprobs: list[float]
    advantages: list[float]
    mask: list[float]
    weights: list[float] | None = None
    ref_logprobs: list[float] | None = None
    ratio_mask: list[float] | None = None

    def __len__(self) -> int:
        return len(self.input_tokens)


def make_datum(prompt: TokenIds, completion: Completion, advantage: float) -> Datum:
    """Build the shifted datum for prompt + completion: the one place the shift happens."""
    tokens = list(prompt) + list(completion.tokens)
    n_prompt = len(prompt)
    n_target = len(tokens) - 1
    pad = n_prompt - 1  # targets before the first completion token belong to the prompt
    return Datum(
        input_tokens=tokens[:-1],
        target_tokens=tokens[1:],
        logprobs=([0.0] * pad + list(completion.logprobs))[:n_target],
        advantages=([0.0] * pad + [float(advantage)] * len(completion.tokens))[:n_target],
        mask=([0.0] * pad + [1.0] * len(completion.tokens))[:n_target],
    )


@dataclass
class LossConfig:
    """Which policy loss (algorithms/losses.py defines each), its knobs, and how the call's
    token losses are normalised (algorithms/aggregation.py)."""

    name: str = "importance_sampling"
    clip_eps: float | None = None       # clip: ratio >= 1 - clip_eps (None: the loss's default)
    clip_eps_high: float | None = None  # ... and ratio <= 1 + clip_eps_high
    clip_ratio_c: float = 0.0           # ppo's dual clip for negative advantages (0 = off)
    dro_beta: float = DEFAULT_DRO_BETA
    aggregation: str = "token_mean"     # token_mean | sequence_mean | constant | sum
    max_tokens: int = 0                 # the per-sequence budget `constant` divides by
    temperature: float = 1.0            # sampling temperature; log-probs are recomputed under it
    kl_coef: float = 0.0                # > 0: + kl_coef x KL(policy || reference) per token
    kl_estimator: str = "k1"            # retrain.algorithms.kl (needs Datum.ref_logprobs)
    ratio_cap: float = 0.0              # > 0: truncated importance sampling (the fast sampler)

    @property
    def thresholds(self) -> tuple[float, float]:
        """The clip bounds (lo, hi) on the ratio, as Tinker's clip_low/high_threshold."""
        return losses.thresholds(self.name, self.clip_eps, self.clip_eps_high)


@dataclass
class LossOutput:
    """What forward_backward reports; `logprobs[i]` holds the target log-probs of datum i."""

    loss: float
    logprobs: list[list[float]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class AdamParams:
    """AdamW hyper-parameters, sent with every optimizer step (schedules live in the trainer)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class OptimOutput:
    grad_norm: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class TokenUsage:
    """The tokens a backend's calls carried, counted since it was built (cumulative): the raw
    figures of the bill. `prefill`: prompt tokens of each sample call (each prompt once per
    call, as sent) and of reference log-prob calls; `sampled`: completion tokens returned;
    `trained`: the tokens of the datums sent to forward_backward."""

    prefill: int = 0
    sampled: int = 0
    trained: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, prefill: int = 0, sampled: int = 0, trained: int = 0) -> None:
        with self._lock:  # sample jobs finish in worker threads
            self.prefill += prefill
            self.sampled += sampled
            self.trained += trained

    def count_sample(self, prompts: list[TokenIds], groups: list[list[Completion]]) -> None:
        self.count(prefill=sum(map(len, prompts)),
                   sampled=sum(len(c.tokens) for g in groups for c in g))

    def snapshot(self) -> tuple[int, int, int]:
        with self._lock:
            return self.prefill, self.sampled, self.trained


def context_overflow(prompt_tokens: int, max_tokens: int, max_context: int | None) -> str | None:
    """Why `prompt_tokens` + `max_tokens` do not fit the model's context (None: they fit, or
    the context is unknown). The one check of the local sampler, the rollout, `retrain
    eval`/`sample` and serve's 400."""
    if max_context is None or prompt_tokens + max_tokens <= max_context:
        return None
    return (f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context of {max_context} tokens")


def finished(call: Callable[..., T], *args: Any) -> Future[T]:
    """`call(*args)` run now, as a completed Future (for backends with nothing to overlap)."""
    future: Future[T] = Future()
    try:
        future.set_result(call(*args))
    except Exception as exc:
        future.set_exception(exc)
    return future


class BackendError(RuntimeError):
    """A backend failure the trainer reports and stops on (after checkpointing)."""


class BackendOOMError(BackendError):
    """Out of memory: the trainer retries the step with a smaller batch and tells the controller."""


class DivergedError(BackendError):
    """The weights are no longer finite numbers (or sample NaN/inf probabilities): an update
    diverged. Nothing non-finite is ever saved; the trainer names the last sound checkpoint.
    `sampling`: raised by sampling, i.e. the weights in use (not an update) are unsound."""

    def __init__(self, message: str, *, sampling: bool = False):
        super().__init__(message)
        self.sampling = sampling


def skipped_nonfinite(metrics: dict[str, float]) -> bool:
    """Whether the backend left an optimizer step out because its loss or gradient was not
    finite (`optim_step` metrics `skipped_nonfinite` = 1: the local backend and `retrain
    serve` say so themselves; the tinker backend also when the grad norm came back
    non-finite)."""
    return bool(metrics.get("skipped_nonfinite"))


@runtime_checkable
class Backend(Protocol):
    """The contract. A backend that writes checkpoints itself is given the run's checkpoints
    folder when it is built (`backends.create_backend`); a remote one keeps them on its service."""

    tokenizer: Any              # a Hugging Face-style tokenizer for rendering prompts
    summary: str                # one line for the run log: which model runs where
    rate_limit_wait_s: float    # seconds spent waiting out the service's rate limits (0 if none)
    cost_model: ModelCost | None  # what FLOPs/bytes estimates need; None where unknown (remote)
    max_context: int | None     # prompt + completion tokens the model takes; None: unknown
    token_usage: TokenUsage     # the tokens its calls carried so far (the bill)

    def sample(self, prompts: list[TokenIds], n: int,
               params: SamplingParams) -> list[list[Completion]]: ...

    def sample_async(self, prompts: list[TokenIds], n: int,
                     params: SamplingParams) -> Future[list[list[Completion]]]:
        """`sample` started now, on the weights as they are now; the result comes later."""
        ...

    def forward_backward(self, datums: list[Datum], loss: LossConfig) -> LossOutput: ...

    def reference_logprobs(self, datums: list[Datum], temperature: float) -> list[list[float]]:
        """The base model's log-probs of each datum's masked targets (0.0 elsewhere): the
        reference of a KL term ([algorithm] kl_coef)."""
        ...

    def optim_step(self, adam: AdamParams) -> OptimOutput: ...

    def thread_metrics(self) -> dict[str, float]:
        """The row's CPU thread metrics as they stand (`cpu_threads`, `others_busy_cores`: the
        local backend's automatic threads; {} elsewhere), for a step without `optim_step`."""
        ...

    def save_state(self, name: str) -> str: ...

    def save_state_async(self, name: str) -> Future[str]:
        """`save_state` started now, behind every update already made; the reference (what
        `load_state` takes) comes later. The trainer uses it to overlap the checkpoint's round
        trips with the next step (training.max_steps_off_policy >= 1)."""
        ...

    def load_state(self, ref: str) -> None: ...

    def close(self) -> None: ...

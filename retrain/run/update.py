"""A step's updates: the loss the [algorithm] section names, `forward_backward` over a
mini-batch of the step's datums, then one `optim_step` with the training section's AdamW
settings; `training.mini_batches` x `training.epochs` such updates per sampled batch.

The ratio of every update is against the sampler's log-probs (the datums keep them), so only
the first mini-batch of the first epoch is on-policy; the later ones are what makes a PPO clip
bind. With 1 x 1 a step is one forward_backward and one optim_step, as it always was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from retrain.algorithms.losses import eps_of
from retrain.backends.base import (
    AdamParams,
    Backend,
    Datum,
    LossConfig,
    LossOutput,
    OptimOutput,
    skipped_nonfinite,
)
from retrain.run.step_row import logprob_diff, mismatch

NO_UPDATE = {"loss": 0.0, "grad_norm": 0.0, "skipped_nonfinite": False,
             "sampler_trainer_logprob_diff": None, "sampler_trainer_logprob_diff_p95": None,
             "sampler_trainer_mismatch_kl": None, "grad_noise_scale": None,
             "grad_coherence": None, "updates": 0, "clip_fraction": None, "ratio_mean": None,
             "ratio_max": None}
# Summed over a step's updates for the cost estimates (every update runs its tokens again).
SUMMED = ("tokens", "grad_micro_batches")


@dataclass
class Update:
    """What one update did: the backend's outputs, and whether the optimizer skipped it."""

    datums: list[Datum]
    loss: LossOutput
    optim: OptimOutput

    @property
    def skipped(self) -> bool:
        """A non-finite loss or gradient: the weights were left as they were."""
        return skipped_nonfinite(self.optim.metrics)


def loss_config(algorithm, training) -> LossConfig:
    """The [algorithm] section's loss, as the backends take it."""
    return LossConfig(name=algorithm.loss, clip_eps=eps_of(algorithm.clip_eps),
                      clip_eps_high=eps_of(algorithm.clip_eps_high),
                      clip_ratio_c=algorithm.clip_ratio_c, dro_beta=algorithm.dro_beta,
                      aggregation=algorithm.loss_aggregation, max_tokens=training.max_tokens,
                      temperature=training.temperature,
                      kl_coef=algorithm.kl_coef if algorithm.kl_in == "loss" else 0.0,
                      kl_estimator=algorithm.kl_estimator)


def update(backend: Backend, datums: list[Datum], algorithm, training, lr: float) -> Update:
    """forward_backward with the configured loss, then optim_step at `lr`."""
    out = backend.forward_backward(datums, loss_config(algorithm, training))
    adam = AdamParams(learning_rate=lr, beta1=training.beta1, beta2=training.beta2,
                      eps=training.adam_eps, weight_decay=training.weight_decay,
                      grad_clip_norm=training.grad_clip_norm)
    return Update(datums=datums, loss=out, optim=backend.optim_step(adam))


def mini_batches(groups: list[list[Datum]], n: int) -> list[list[Datum]]:
    """The step's groups in `n` contiguous parts of (nearly) equal group counts, groups whole;
    fewer parts when there are fewer groups with datums than `n`."""
    groups = [g for g in groups if g]
    k = min(n, len(groups))
    bounds = [i * len(groups) // k for i in range(k + 1)] if k else [0]
    return [[d for g in groups[bounds[i]:bounds[i + 1]] for d in g] for i in range(k)]


# The local backend's automatic CPU threads after the step (backends/local/threads.py).
THREAD_METRICS = ("cpu_threads", "others_busy_cores")


def update_batch(backend: Backend, groups: list[list[Datum]], algorithm, training,
                 lr: float) -> list[Update]:
    """`training.epochs` passes over `training.mini_batches` parts of the step's groups, one
    optimizer step per part, in a fixed order (so a resumed run repeats it)."""
    parts = mini_batches(groups, training.mini_batches)
    return [update(backend, part, algorithm, training, lr)
            for _ in range(training.epochs) for part in parts]


def summary(done: list[Update]) -> tuple[dict, dict]:
    """(the row's numbers about a step's updates, the backend metrics the cost estimates and
    the gradient noise read). The loss and grad norm are means over the updates; the
    sampler/trainer log-prob gap is the first (on-policy) update's."""
    first = done[0]
    applied = [u for u in done if not u.skipped]
    row = {"loss": _mean([u.loss.loss for u in done]),
           "grad_norm": _mean([u.optim.grad_norm for u in done]),
           "skipped_nonfinite": len(applied) < len(done),
           "sampler_trainer_logprob_diff": logprob_diff(first.datums, first.loss.logprobs),
           **mismatch(first.datums, first.loss.logprobs),
           "updates": len(applied), **ratio_metrics(done),
           **{k: v for k, v in done[-1].optim.metrics.items() if k in THREAD_METRICS}}
    metrics = dict(first.loss.metrics)
    for key in SUMMED:
        if key in metrics:
            metrics[key] = float(sum(u.loss.metrics.get(key, 0.0) for u in done))
    return row, metrics


def ratio_metrics(done: list[Update]) -> dict:
    """clip_fraction (as the backend reports it, token-weighted over the updates; None where
    it does not), ratio_mean and ratio_max of p_trainer / p_sampler over the completion tokens,
    read from the log-probs every backend returns (Tinker reports no ratio metrics)."""
    clipped, clip_tokens, total, count, peak = 0.0, 0.0, 0.0, 0, -math.inf
    cut, cut_tokens = 0.0, 0.0
    for u in done:
        tokens = float(u.loss.metrics.get("tokens", 0.0))
        if "clip_fraction" in u.loss.metrics:
            clipped += u.loss.metrics["clip_fraction"] * tokens
            clip_tokens += tokens
        if "ratio_truncated" in u.loss.metrics:
            cut += u.loss.metrics["ratio_truncated"] * tokens
            cut_tokens += tokens
        for d, lps in zip(u.datums, u.loss.logprobs, strict=True):
            for old, new, m in zip(d.logprobs, lps, d.mask, strict=True):
                if m:
                    r = math.exp(min(new - old, 700.0))
                    total, count, peak = total + r, count + 1, max(peak, r)
    out = {"clip_fraction": clipped / clip_tokens if clip_tokens else None,
           "ratio_mean": total / count if count else None,
           "ratio_max": peak if count else None}
    if cut_tokens:  # with a ratio cap (the fast sampler): the share of tokens it cut
        out["ratio_truncated"] = cut / cut_tokens
    return out


def _mean(values: list[float]) -> float:
    return values[0] if len(values) == 1 else sum(values) / len(values)

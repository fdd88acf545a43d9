"""One step's metrics row: the promised keys in a fixed order, and the numbers derived for it."""

from __future__ import annotations

import math
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from retrain.algorithms.advantages import mean_and_std, uniform_group_rate
from retrain.backends.base import Datum
from retrain.control.gradnoise import GradStats
from retrain.control.stepcost import step_cost
from retrain.control.work import StepWork

ROW_ORDER = ("step", "batch_size", "group_size", "num_completions", "mean_reward", "reward_std",
             "correct_rate", "max_token_hit_rate", "mean_completion_tokens", "loss",
             "grad_norm", "lr", "step_time_s", "sample_time_s", "reward_time_s", "train_time_s",
             "tokens_per_second", "reward_uniform_group_rate", "sampler_trainer_logprob_diff",
             "process_max_rss_mb", "api_wait_s", "reward_failures", "oom_retries")


def ordered(row: dict, bp: dict) -> dict:
    """The promised keys first, in a fixed order; then the phase ("rl"; an [sft] stage's rows
    say "sft"), extras, time and the bp_* metrics."""
    out = {k: row[k] for k in ROW_ORDER}
    out["phase"] = "rl"
    out.update((k, v) for k, v in row.items() if k not in out)
    out["time"] = time.time()
    out.update(bp)
    return out


def logprob_diff(datums: list[Datum], trainer_logprobs: list[list[float]]) -> float | None:
    """Mean |trainer - sampler| log-prob over the completion tokens (~0 means same policy)."""
    gaps = _gaps(datums, trainer_logprobs)
    return sum(abs(g) for g in gaps) / len(gaps) if gaps else None


def mismatch(datums: list[Datum], trainer_logprobs: list[list[float]]) -> dict:
    """How far the sampler's distribution is from the trainer's, over the completion tokens:
    the 95th percentile of |trainer - sampler| log-prob and the mean k3 estimate of
    KL(sampler || trainer), r - 1 - log r with r = p_trainer / p_sampler (>= 0, unbiased for
    tokens drawn by the sampler). A mean gap can hide a few tokens far apart; these show them."""
    gaps = _gaps(datums, trainer_logprobs)
    if not gaps:
        return {"sampler_trainer_logprob_diff_p95": None, "sampler_trainer_mismatch_kl": None}
    ranked = sorted(abs(g) for g in gaps)
    p95 = ranked[min(len(ranked) - 1, math.ceil(0.95 * len(ranked)) - 1)]
    kl = sum(math.expm1(min(g, 700.0)) - g for g in gaps) / len(gaps)
    return {"sampler_trainer_logprob_diff_p95": p95, "sampler_trainer_mismatch_kl": kl}


def _gaps(datums: list[Datum], trainer_logprobs: list[list[float]]) -> list[float]:
    """trainer - sampler log-prob of every trained completion token."""
    return [new - old for d, lps in zip(datums, trainer_logprobs, strict=True)
            for old, new, m in zip(d.logprobs, lps, d.mask, strict=True) if m]


def max_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def step_work(sizes: list[list[tuple[int, int]]], advantages: list[list[float]]) -> StepWork:
    """Tokens sampled and trained, groups trained (a uniform group has no advantage) and the
    tokens a batched decode runs (every episode as long as the longest). `sizes` holds, per
    group and episode, (context tokens, sampled tokens): the context is the prompt and
    everything the environment wrote."""
    sampled = [(p, c, a != 0.0)
               for group, adv in zip(sizes, advantages, strict=True)
               for (p, c), a in zip(group, adv, strict=True)]
    return StepWork(prompt_tokens=sum(p for p, _, _ in sampled),
                    completion_tokens=sum(c for _, c, _ in sampled),
                    trained_tokens=sum(p + c for p, c, trained in sampled if trained),
                    groups_trained=sum(any(a != 0.0 for a in adv) for adv in advantages),
                    decoded_tokens=len(sampled) * max((c for _, c, _ in sampled), default=0))


@dataclass
class SampledStep:
    """What one attempt at a step produced, before the metrics row is assembled."""

    row: dict
    work: StepWork                       # what the step did, for the back-pressure controller
    errors: list[str] = field(default_factory=list)
    flops: float | None = None           # estimates for the roofline (retrain.control.stepcost)
    bytes_moved: float | None = None
    noise_scale: float | None = None     # gradient noise scale in prompts, for goodput

    @property
    def tokens(self) -> int:
        return self.work.sampled_tokens

    def add_estimates(self, cost_model: Any, groups: list[list[Any]], train_metrics: dict,
                      batch_size: int) -> None:
        """FLOPs and bytes for the roofline; the noise scale in prompts for goodput.
        `groups`: the step's episodes, per group."""
        if cost_model is not None:
            est = step_cost(cost_model, [g[0].ledger.context_tokens for g in groups],
                            [[e.ledger.sampled_tokens for e in g] for g in groups],
                            int(train_metrics.get("tokens", 0)),
                            int(train_metrics.get("grad_micro_batches", 1)))
            self.flops, self.bytes_moved = est.flops, est.bytes_moved
        scale, stats = self.row.get("grad_noise_scale"), GradStats.from_metrics(train_metrics)
        if scale is not None and stats is not None:
            self.noise_scale = scale / (stats.big_tokens / batch_size)


def rollout_row(result: Any, rewards: list[list[float]], batch_size: int, group_size: int,
                train: dict) -> dict:
    """The row's numbers about the episodes of a step (`result`: a RolloutResult) and its
    update (`train`)."""
    episodes = [e for g in result.groups for e in g]
    n, replies = len(episodes), sum(e.turns for e in episodes)
    flat = [r for g in rewards for r in g]
    mean_reward, reward_std = mean_and_std(flat)  # overflow-safe (1e200 rewards)
    return {
        "batch_size": batch_size, "group_size": group_size,
        "num_completions": n, "mean_reward": mean_reward, "reward_std": reward_std,
        "correct_rate": sum(e.success for e in episodes) / n,
        "max_token_hit_rate": sum(e.cut_replies for e in episodes) / max(1, replies),
        "mean_completion_tokens": sum(e.ledger.sampled_tokens for e in episodes) / n,
        **train, "reward_uniform_group_rate": uniform_group_rate(rewards),
        **getattr(result, "reward_metrics", {}),
    }

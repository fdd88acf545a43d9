"""One step's metrics row: the promised keys in a fixed order, and the numbers derived for it."""

from __future__ import annotations

import resource
import sys
import time

from retrain.backends.base import Datum
from retrain.control.work import StepWork

ROW_ORDER = ("step", "batch_size", "group_size", "num_completions", "mean_reward", "reward_std",
             "correct_rate", "max_token_hit_rate", "mean_completion_tokens", "loss",
             "grad_norm", "lr", "step_time_s", "sample_time_s", "reward_time_s", "train_time_s",
             "tokens_per_second", "reward_uniform_group_rate", "sampler_trainer_logprob_diff",
             "process_max_rss_mb", "api_wait_s", "reward_failures", "oom_retries")


def ordered(row: dict, bp: dict) -> dict:
    """The promised keys first, in a fixed order; then extras, time and the bp_* metrics."""
    out = {k: row[k] for k in ROW_ORDER}
    out.update((k, v) for k, v in row.items() if k not in out)
    out["time"] = time.time()
    out.update(bp)
    return out


def logprob_diff(datums: list[Datum], trainer_logprobs: list[list[float]]) -> float | None:
    """Mean |trainer - sampler| log-prob over the completion tokens (~0 means same policy)."""
    total, count = 0.0, 0
    for d, lps in zip(datums, trainer_logprobs, strict=True):
        for old, new, m in zip(d.logprobs, lps, d.mask, strict=True):
            if m:
                total += abs(new - old)
                count += 1
    return total / count if count else None


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

"""A sampled evaluation's figures (`[training] eval_samples = k`): mean@k, pass@k and the
standard error of mean@k, for the trainer's eval rows and `retrain eval`. Pure: no I/O
(floor 1, like run/seeds.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AtK:
    """k sampled completions per problem: mean@k, the per-problem success rate averaged (an
    unbiased pass@1); pass@k, the share of problems some sample solves; mean_at_k_se, the
    standard error of mean@k over problems (None for fewer than 2 problems)."""

    k: int
    problems: int
    mean_at_k: float
    pass_at_k: float
    mean_at_k_se: float | None


def at_k(successes: list[list[bool]]) -> AtK:
    """mean@k, pass@k and the standard error of mean@k of `successes` (per problem, its k
    samples' successes; every problem has the same k >= 1)."""
    if not successes:
        return AtK(0, 0, 0.0, 0.0, None)
    k, n = len(successes[0]), len(successes)
    if k == 0 or any(len(s) != k for s in successes):
        raise ValueError("at_k: every problem needs the same k >= 1 samples")
    rates = [sum(s) / k for s in successes]
    m = math.fsum(rates) / n
    se = math.sqrt(math.fsum((r - m) ** 2 for r in rates) / (n - 1) / n) if n > 1 else None
    return AtK(k, n, m, sum(1 for s in successes if any(s)) / n, se)

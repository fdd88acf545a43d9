"""Capacity planning: completions per step, total steps, parallelism, wall time.

Pure formulas (no I/O), shared by `explain` (before a campaign) and `status` (during one):

    completions per step  = batch_size * group_size
    total steps           = sum of max_steps over the runs (runs x max_steps)
    effective parallelism = min(max_workers, runs) when parallel (0 workers = all), else 1
    wall time             = median_step_time * total_steps / effective_parallelism
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable


def completions_per_step(batch_size: int, group_size: int) -> int:
    """Completions sampled per training step (the concurrency p of the USL model)."""
    return batch_size * group_size


def total_steps(max_steps_per_run: Iterable[int]) -> int:
    """Training steps of a whole campaign: the sum over its runs."""
    return sum(max_steps_per_run)


def effective_parallelism(parallel: bool, max_workers: int, runs: int) -> int:
    """Workers that can be alive at once: min(max_workers, runs) when parallel, else 1."""
    if runs <= 0:
        return 0
    if not parallel:
        return 1
    return runs if max_workers <= 0 else min(max_workers, runs)


def wall_time_s(median_step_time_s: float, steps: int, parallelism: int) -> float:
    """Estimated seconds to run `steps` steps spread over `parallelism` workers."""
    if steps <= 0 or parallelism <= 0:
        return 0.0
    return median_step_time_s * steps / parallelism


def median_step_time(values: Iterable[object]) -> float | None:
    """Median of the finite, positive numbers in `values` (None when there are none)."""
    good = [float(v) for v in values
            if isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v) and v > 0]
    return statistics.median(good) if good else None


def human_duration(seconds: float) -> str:
    """'45s', '12m 5s', '3h 20m', '2d 4h': short and exact enough for a plan."""
    if not math.isfinite(seconds) or seconds > 1e12:  # broken step times: no absurd dates
        return "more than 30000 years"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m {s}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h {m}m"
    d, h = divmod(h, 24)
    return f"{d}d {h}h"

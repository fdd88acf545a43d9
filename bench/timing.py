"""Timing helper shared by the in-process benchmarks (dtype_speed, step_ablation)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """(median seconds over `repeat` calls after one warm-up call, the last call's result).

    The warm-up absorbs allocator growth and kernel selection (oneDNN, CUDA)."""
    out = fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def interleaved(fns: dict[str, Callable[[], Any]], repeat: int) -> dict[str, tuple[float, Any]]:
    """`timed` for several variants at once, run in turn (ABC ABC ..., the order rotated each
    round) so that a machine whose speed drifts slows every variant alike: name -> (median
    seconds over `repeat` rounds after one warm-up each, the last call's result)."""
    names = list(fns)
    out = {name: fns[name]() for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    for rnd in range(repeat):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            start = time.perf_counter()
            out[name] = fns[name]()
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(times[name]), out[name]) for name in names}

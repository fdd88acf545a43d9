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

"""Roofline placement of one step: is it limited by arithmetic or by memory traffic?

Pure: no torch, no I/O. The FLOPs and bytes estimates of a step come from
`retrain.control.stepcost`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

MEMORY_BOUND_RATIO = 1.10  # smoothed throughput above the fit's prediction by > 10%
OPTIMAL_FLOOR = 0.80       # ... below 80% of it: the fit no longer describes the machine


@dataclass(frozen=True)
class Roofline:
    """One step placed on the roofline: intensity in FLOP/byte, fractions of each peak."""

    intensity: float         # FLOP per byte moved
    balance: float           # machine balance: peak FLOP/s / peak byte/s (FLOP per byte)
    compute_fraction: float  # achieved FLOP/s / peak FLOP/s
    memory_fraction: float   # achieved byte/s / peak byte/s

    @property
    def regime(self) -> str:
        # intensity >= balance  <=>  compute_fraction >= memory_fraction (same comparison).
        return "compute_bound" if self.intensity >= self.balance else "memory_bound"


def roofline(flops: float | None, bytes_moved: float | None, step_time_s: float,
             peak_gflops: float, peak_bw_gb_s: float) -> Roofline | None:
    """Place a step on the roofline, or None without hints (or with unusable ones)."""
    values = (flops, bytes_moved, step_time_s, peak_gflops, peak_bw_gb_s)
    if not all(is_positive(v) for v in values):
        return None
    flops, bytes_moved, step_time_s = float(flops), float(bytes_moved), float(step_time_s)
    peak_flops = peak_gflops * 1e9          # GFLOP/s -> FLOP/s
    peak_bytes = peak_bw_gb_s * 1e9         # GB/s -> byte/s
    r = Roofline(intensity=flops / bytes_moved, balance=peak_flops / peak_bytes,
                 compute_fraction=flops / step_time_s / peak_flops,
                 memory_fraction=bytes_moved / step_time_s / peak_bytes)
    finite = all(math.isfinite(v) for v in (r.intensity, r.balance, r.compute_fraction,
                                            r.memory_fraction))
    return r if finite else None


def is_positive(v: object) -> bool:
    """A finite number > 0 (numpy scalars included, booleans not)."""
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        return False
    try:
        f = float(v)
    except (OverflowError, ValueError):
        return False
    return math.isfinite(f) and f > 0


def regime_from_fit(ratio: float) -> str:
    """Without FLOP and byte hints: the regime from smoothed throughput / the USL fit's
    prediction at the current p."""
    if ratio > MEMORY_BOUND_RATIO:
        return "memory_bound"
    if ratio >= OPTIMAL_FLOOR:
        return "optimal"
    return "warmup"            # far below the fit: it may be stale; hold

"""How much CPU other processes take, and how many threads that leaves a run.

Beside a busy process, torch threads that spin at OpenMP barriers burn the core their partner
needs (a step 6x slower, bench/outside_load.py); sleeping waits (OMP_WAIT_POLICY=PASSIVE) avoid
that but cost a quiet machine 17-28%. A run with only as many threads as the cores others leave
free keeps libgomp's fast spinning waits and never waits on a preempted partner.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

STAT_PATH = "/proc/stat"
# Other processes using at least this much of a core, averaged over the window, take it.
TAKEN_CORE = 0.6


@dataclass(frozen=True)
class CpuSample:
    """CPU-seconds spent so far: by every core (busy, not idle) and by this process."""

    wall_s: float
    busy_s: float
    own_s: float


def busy_seconds(stat_line: str, ticks_per_s: float) -> float:
    """Busy CPU-seconds since boot from /proc/stat's `cpu` line: every field but idle and
    iowait, and without guest time (already counted in user and nice)."""
    fields = [int(v) for v in stat_line.split()[1:]]
    idle = sum(fields[3:5])
    guest = sum(fields[8:10])
    return (sum(fields) - idle - guest) / ticks_per_s


def cpu_sample(path: str = STAT_PATH) -> CpuSample | None:
    """Now's sample, or None where the OS has no /proc/stat (not Linux)."""
    try:
        with open(path, encoding="ascii") as fh:
            line = fh.readline()
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    if not line.startswith("cpu "):
        return None
    return CpuSample(time.monotonic(), busy_seconds(line, ticks), time.process_time())


def others_busy_cores(before: CpuSample, after: CpuSample) -> float:
    """Cores' worth of CPU that processes other than this one used between two samples."""
    wall = after.wall_s - before.wall_s
    if wall <= 0:
        return 0.0
    others = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    return max(0.0, others / wall)


def threads_left(cores: int, others: float, most: int) -> int:
    """Threads for a run on `cores` cores while others use `others` of them: one per core they
    leave (a core counts as taken from TAKEN_CORE of its time), at least 1, at most `most`."""
    taken = math.floor(others + 1.0 - TAKEN_CORE)
    return max(1, min(most, cores - taken))

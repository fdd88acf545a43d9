"""`[model] threads = 0` on a CPU: torch's threads fit the cores other processes leave free,
chosen while the model loads and checked again at every sampling call and optimizer step, a
second apart at least (issue 47 item 15; why: retrain/machine/cpu_share.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from retrain.machine.cpu import auto_threads, available_cores
from retrain.machine.cpu_share import CpuSample, cpu_sample, others_busy_cores, threads_left

# Shorter windows are mostly jiffy rounding (10 ms ticks): a check this soon after the last
# waits for the next one.
MIN_WINDOW_S = 1.0


class CpuThreads:
    """The thread count of one process's CPU work, between 1 and `most` (the automatic count:
    every core, or the campaign worker's share)."""

    def __init__(self, cores: int, most: int, since: CpuSample | None,
                 sample: Callable[[], CpuSample | None] = cpu_sample):
        self.sample = sample  # the OS's counters (tests script them: nobody scripts the OS)
        self.cores = cores
        self.most = most
        self.threads = most
        self.last = since
        self.others = 0.0

    def check(self) -> int | None:
        """Measure what others used since the last check and fit the threads to it; the new
        count when it changed, else None."""
        now = self.sample()
        if now is None or self.last is None or now.wall_s - self.last.wall_s < MIN_WINDOW_S:
            return None
        self.others = others_busy_cores(self.last, now)
        self.last = now
        threads = threads_left(self.cores, self.others, self.most)
        if threads == self.threads:
            return None
        torch.set_num_threads(threads)
        self.threads = threads
        return threads

    def metrics(self) -> dict[str, float]:
        """What the step's row records: the threads it ran with, the cores others used."""
        return {"cpu_threads": float(self.threads), "others_busy_cores": self.others}


def fitted_at_load(threads: int, device_type: str, since: CpuSample | None) -> CpuThreads | None:
    """With `[model] threads = 0` on a CPU, the automatic threads fitted to what other processes
    used since `since` (taken before the weights loaded); else None (the user's count stands)."""
    if threads or device_type != "cpu":
        return None
    auto = CpuThreads(available_cores(), auto_threads(), since)
    auto.check()
    return auto

"""How many CPU threads torch should use when `[model].threads = 0` (automatic)."""

from __future__ import annotations

import os

# Set by the campaign runner: each local worker's share of the cores.
AUTO_THREADS_ENV = "RETRAIN_AUTO_THREADS"


def available_cores() -> int:
    """Cores this process may run on (cgroup/affinity aware where the OS says)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def auto_threads() -> int:
    """The campaign's per-worker share when set, else every available core."""
    share = os.environ.get(AUTO_THREADS_ENV, "")
    return int(share) if share.isdigit() and int(share) > 0 else available_cores()

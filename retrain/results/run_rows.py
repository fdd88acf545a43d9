"""A run's metrics rows as the results commands read them (through runlog): one row per
step in step order, and the finite numbers of one key."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from retrain.runfiles import runlog


def read_rows(run_dir: Path) -> list[dict]:
    """Metrics rows by step (a repeated step keeps its last row), in step order; torn and
    garbage lines are skipped (runlog counts them)."""
    by_step: dict[int, dict] = {}
    for row in runlog.read_metrics(Path(run_dir) / runlog.METRICS_FILE).rows:
        step = row.get("step")
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            by_step[step] = row
    return [by_step[s] for s in sorted(by_step)]


def number(v: Any) -> float | None:
    """A finite number as float, else None (bools, strings and nulls are not numbers)."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return float(v) if ok else None


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of the rows where `key` holds a finite number."""
    return [(r["step"], x) for r in rows if (x := number(r.get(key))) is not None]

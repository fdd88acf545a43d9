"""A run's metrics rows as the results commands (and a race) read them, through runlog: one row
per step in step order, and the finite numbers of one key.

Rows that cannot be trusted are dropped, never averaged in, and counted so that the reader can
say which file they came from: torn or garbage lines, every row of a step logged more than once
(the trainer truncates metrics.jsonl on resume, so a repeated step is a foreign or hand-edited
file: which of its rows is the step is unknown), and rows whose figures are not finite numbers
(NaN, an infinity, or null: the trainer writes a non-finite value as null).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrain.runfiles import runlog

# The figures `compare` and a race read from a row: a row where one is present but not a
# finite number is dropped whole.
FIGURE_KEYS = ("mean_reward", "eval_accuracy", "step_time_s", "tokens_per_second")


@dataclass
class RunRows:
    """The rows kept, and what was dropped from `path`."""

    path: str
    rows: list[dict] = field(default_factory=list)
    bad_lines: int = 0                                           # torn or garbage lines
    duplicate_steps: list[int] = field(default_factory=list)     # steps logged more than once
    duplicate_rows: int = 0                                      # ... their rows, all dropped
    non_finite_steps: list[int] = field(default_factory=list)    # rows with a non-finite figure

    @property
    def skipped(self) -> int:
        return self.bad_lines + self.duplicate_rows + len(self.non_finite_steps)

    def note(self) -> str:
        """What was dropped, in words ('' when nothing was)."""
        parts = []
        if self.bad_lines:
            parts.append(f"{self.bad_lines} torn or garbage line{_s(self.bad_lines)}")
        if self.duplicate_rows:
            parts.append(f"{self.duplicate_rows} rows of step{_s(len(self.duplicate_steps))} "
                         f"logged more than once ({_steps(self.duplicate_steps)})")
        if self.non_finite_steps:
            n, steps = len(self.non_finite_steps), _steps(self.non_finite_steps)
            parts.append(f"{n} row{_s(n)} with a non-finite figure ({steps})")
        return ", ".join(parts)


def read_run_rows(run_dir: Path) -> RunRows:
    """The run's rows by step, in step order, with what was dropped (see the module docstring).
    Rows without a step number (not the trainer's) are ignored."""
    path = Path(run_dir) / runlog.METRICS_FILE
    read = runlog.read_metrics(path)
    out = RunRows(path=str(path), bad_lines=read.bad_lines)
    by_step: dict[int, list[dict]] = {}
    for row in read.rows:
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            continue
        if any(k in row and number(row[k]) is None for k in FIGURE_KEYS):
            out.non_finite_steps.append(step)
            continue
        by_step.setdefault(step, []).append(row)
    for step in sorted(by_step):
        rows = by_step[step]
        if len(rows) > 1:
            out.duplicate_steps.append(step)
            out.duplicate_rows += len(rows)
        else:
            out.rows.append(rows[0])
    return out


def read_rows(run_dir: Path) -> list[dict]:
    """The rows `read_run_rows` keeps."""
    return read_run_rows(run_dir).rows


def number(v: Any) -> float | None:
    """A finite number as float, else None (bools, strings and nulls are not numbers)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        x = float(v)
    except OverflowError:  # an integer beyond the float range
        return None
    return x if math.isfinite(x) else None


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of the rows where `key` holds a finite number."""
    return [(r["step"], x) for r in rows if (x := number(r.get(key))) is not None]


def _s(n: int) -> str:
    return "" if n == 1 else "s"


def _steps(steps: list[int], limit: int = 5) -> str:
    shown = ", ".join(str(s) for s in steps[:limit])
    more = f" and {len(steps) - limit} more" if len(steps) > limit else ""
    return f"step{_s(len(steps))} {shown}{more}"

"""What a run spent, as its metrics rows record it: each row holds the deltas since the row
before (`prefill_tokens`, `sampled_tokens`, `trained_tokens`, `judge_input_tokens`,
`judge_output_tokens`, `wall_s`, `device_s`: wall seconds x the run's ranks); a run's tally
is their sum."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

# tally field -> the metric of a row that holds its per-row delta
METRICS = {"prefill": "prefill_tokens", "sampled": "sampled_tokens",
           "trained": "trained_tokens", "judge_input": "judge_input_tokens",
           "judge_output": "judge_output_tokens", "wall_s": "wall_s", "device_s": "device_s"}
REAL = ("wall_s", "device_s")  # seconds; the rest are token counts
JUDGE_TOKENS = (METRICS["judge_input"], METRICS["judge_output"])


@dataclass
class Tally:
    """Tokens and wall seconds spent (a row's, a run's or a campaign's)."""

    prefill: int = 0
    sampled: int = 0
    trained: int = 0
    judge_input: int = 0
    judge_output: int = 0
    wall_s: float = 0.0
    # wall seconds x devices (a run's ranks): what device_hour prices; None: one device
    device_s: float | None = None

    def __post_init__(self) -> None:
        if self.device_s is None:
            self.device_s = self.wall_s

    @property
    def tokens(self) -> int:
        """The tokens a `budget_tokens` counts: prefill + sampled + trained."""
        return self.prefill + self.sampled + self.trained

    @property
    def device_hours(self) -> float:
        return (self.device_s or 0.0) / 3600.0

    def __add__(self, other: Tally) -> Tally:
        return Tally(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                        for f in fields(self)})

    def __sub__(self, other: Tally) -> Tally:
        return Tally(**{f.name: getattr(self, f.name) - getattr(other, f.name)
                        for f in fields(self)})

    def row(self) -> dict[str, float]:
        """The row's metrics, by name."""
        return {metric: getattr(self, name) for name, metric in METRICS.items()}

    def as_dict(self) -> dict[str, float]:
        """By field name (what manifests and state files keep)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, raw: Any) -> Tally:
        """From `as_dict`'s form; missing or unreadable fields count 0."""
        raw = raw if isinstance(raw, Mapping) else {}
        return cls(**{name: _number(raw.get(name), name in REAL) for name in METRICS
                      if name != "device_s" or name in raw})

    @classmethod
    def of_row(cls, row: Mapping[str, Any]) -> Tally:
        """One metrics row's spend (rows from before token accounting count 0)."""
        return cls(**{name: _number(row.get(metric), name in REAL)
                      for name, metric in METRICS.items()
                      if name != "device_s" or metric in row})  # older rows: one device

    @classmethod
    def of_rows(cls, rows: Iterable[Mapping[str, Any]]) -> Tally:
        total = cls()
        for row in rows:
            total = total + cls.of_row(row)
        return total


def _number(value: Any, real: bool) -> Any:
    """A count as the row holds it; 0 for anything that is not a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0 if real else 0
    if not math.isfinite(value) or value < 0:
        return 0.0 if real else 0
    return float(value) if real else int(value)

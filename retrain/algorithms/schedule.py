"""The learning-rate schedule: a step's multiplier of training.lr (pure).

A function of the step alone, so a resumed run takes the same learning rate as an
uninterrupted one. Steps count from 1.

- warm-up: steps 1..warmup_steps rise linearly to the full rate (step / warmup_steps);
- then, over the steps after the warm-up up to max_steps (progress p from 0 to 1):
  constant: 1; linear: 1 - (1 - min_lr_ratio) p; cosine: min_lr_ratio + (1 - min_lr_ratio)
  (1 + cos(pi p)) / 2. The last step ends at min_lr_ratio (OpenRLHF's cosine with a floor).
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_multiplier(step: int, max_steps: int, schedule: str, warmup_steps: int = 0,
                  min_lr_ratio: float = 0.0) -> float:
    """The factor training.lr is multiplied by at `step` (see the module docstring)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; expected one of {SCHEDULES}")
    if step <= warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max_steps - warmup_steps
    progress = min(1.0, (step - warmup_steps) / span) if span > 0 else 1.0
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape

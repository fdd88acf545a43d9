"""The learning-rate schedule: a step's multiplier of training.lr (pure).

A function of the step alone, so a resumed run takes the same learning rate as an
uninterrupted one. Steps count from 1.

- warm-up: steps 1..warmup_steps rise linearly to the full rate (step / warmup_steps);
- then the D = max_steps - warmup_steps decay steps k = 1..D, at progress p = (k - 1) / D:
  constant: 1; linear: 1 - (1 - min_lr_ratio) p; cosine: min_lr_ratio + (1 - min_lr_ratio)
  (1 + cos(pi p)) / 2. The first decay step trains at the full rate and the rate reaches
  lr x min_lr_ratio one step after the last, so no step trains at lr 0 (the last linear one
  at min_lr_ratio + (1 - min_lr_ratio) / D): the convention of transformers'
  get_linear_schedule_with_warmup and get_cosine_schedule_with_warmup.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_multiplier(step: int, max_steps: int, schedule: str, warmup_steps: int = 0,
                  min_lr_ratio: float = 0.0) -> float:
    """The factor training.lr is multiplied by at `step` (see the module docstring)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; expected one of {SCHEDULES}")
    if step < 1:
        raise ValueError(f"steps count from 1, got {step}")
    if step <= warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max_steps - warmup_steps
    progress = min(1.0, (step - warmup_steps - 1) / span) if span > 0 else 1.0
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def warmup_problem(max_steps: int, warmup_steps: int, schedule: str) -> str:
    """A warm-up that takes the whole run ("" when it does not): the steps then train below
    training.lr, and a schedule's decay never starts."""
    if not warmup_steps or warmup_steps < max_steps or not max_steps:
        return ""
    reached = "reaches training.lr only at the last step" if warmup_steps == max_steps else \
        f"never reaches training.lr (the last step trains at {max_steps / warmup_steps:.2g} x lr)"
    decay = "" if schedule == "constant" else f" and the {schedule} decay never starts"
    return (f"training.warmup_steps ({warmup_steps}) >= training.max_steps ({max_steps}): the "
            f"warm-up takes the whole run, the rate {reached}{decay}; "
            "lower warmup_steps (e.g. to a tenth of max_steps)")

"""The learning rate of a step (pure)."""

from __future__ import annotations

import math


def step_lr(lr: float, base_batch_size: int, batch_size: int, lr_scaling: str,
            backpressure_enabled: bool) -> float:
    """`lr`, scaled for a batch the back-pressure controller chose ([backpressure] lr_scaling:
    "none", "sqrt" or "linear" in batch_size / base_batch_size)."""
    if not backpressure_enabled or lr_scaling == "none":
        return lr
    ratio = batch_size / base_batch_size
    return lr * (math.sqrt(ratio) if lr_scaling == "sqrt" else ratio)

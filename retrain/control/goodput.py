"""Goodput (Pollux, OSDI 2021): throughput x statistical efficiency of the batch size.

Pure: no torch, no I/O. The efficiency comes from the gradient noise scale (McCandlish et
al. 2018), measured by `retrain.control.gradnoise`.
"""

from __future__ import annotations

from retrain.control.usl import UslFit


def statistical_efficiency(noise_scale: float, batch_size: float, base_batch_size: float) -> float:
    """Pollux's efficiency of batch M relative to M0: (φ + M0) / (φ + M), φ = noise scale.

    Progress per example at M, relative to M0 (with the learning rate scaled to match): 1 at
    M0, above 1 for smaller batches, falling towards M0/M once M is well past φ."""
    return (noise_scale + base_batch_size) / (noise_scale + batch_size)


def goodput_batch(fit: UslFit, group_size: int, lo: int, hi: int, noise_scale: float,
                  base_batch_size: int) -> int:
    """The batch size in [lo, hi] with the highest fitted throughput x statistical efficiency."""
    def goodput(b: int) -> float:
        return (fit.throughput(b * group_size)
                * statistical_efficiency(noise_scale, b, base_batch_size))

    return max(range(lo, hi + 1), key=goodput)

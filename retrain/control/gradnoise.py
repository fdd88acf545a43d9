"""Gradient noise scale (McCandlish et al. 2018) from the micro-batches of one step.

Pure: no torch, no I/O. The local backend measures, per step, the squared norm of each
micro-batch's own (token-mean) gradient and of the whole step's gradient, on the LoRA
parameters; this module turns them into B_simple = tr(Σ) / |G|², in trained tokens.

With micro-batches of B_i tokens, E|g_i|² = |G|² + S / B_i, so their mean is
|G|² + S / B_small with B_small the harmonic mean of the B_i; the whole step's gradient
(B_big tokens) has E|G_big|² = |G|² + S / B_big. Two equations, two unknowns: the unbiased
two-batch-size estimator of the paper's appendix A.1. Each estimate is noisy (it can even be
negative), so |G|² and S are EMA-smoothed separately and divided afterwards, as in the paper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

NOISE_SCALE_DECAY = 0.9    # EMA decay across steps of the |G|² and S estimates


@dataclass(frozen=True)
class GradStats:
    """One step's gradient measurements (local backend, two or more micro-batches)."""

    micro_batches: int
    small_sq_norm: float   # mean over micro-batches of |g_i|², g_i = micro-batch i's mean gradient
    small_tokens: float    # harmonic mean of the micro-batches' trained tokens
    big_sq_norm: float     # |G_big|², the whole step's token-mean gradient
    big_tokens: float      # trained tokens of the whole step
    coherence: float | None  # mean cosine similarity of successive micro-batch gradients

    @classmethod
    def from_metrics(cls, metrics: dict) -> GradStats | None:
        """From a LossOutput's metrics; None when the backend did not measure them (Tinker)
        or the step had a single micro-batch (there is then nothing to compare)."""
        try:
            stats = cls(int(metrics["grad_micro_batches"]), float(metrics["grad_small_sq_norm"]),
                        float(metrics["grad_small_tokens"]), float(metrics["grad_big_sq_norm"]),
                        float(metrics["grad_big_tokens"]), metrics.get("grad_coherence"))
        except (KeyError, TypeError, ValueError):
            return None
        values = (stats.small_sq_norm, stats.small_tokens, stats.big_sq_norm, stats.big_tokens)
        usable = stats.micro_batches >= 2 and all(math.isfinite(v) for v in values) \
            and 0 < stats.small_tokens < stats.big_tokens
        return stats if usable else None


def two_batch_estimates(s: GradStats) -> tuple[float, float]:
    """Unbiased (|G|², S = tr Σ) from the small and the big batch (McCandlish et al., A.1)."""
    g2 = (s.big_tokens * s.big_sq_norm - s.small_tokens * s.small_sq_norm) \
        / (s.big_tokens - s.small_tokens)
    trace = (s.small_sq_norm - s.big_sq_norm) / (1 / s.small_tokens - 1 / s.big_tokens)
    return g2, trace


@dataclass
class NoiseScale:
    """EMA-smoothed B_simple across steps, in trained tokens (debiased like Adam's moments)."""

    decay: float = NOISE_SCALE_DECAY
    g2: float = 0.0
    trace: float = 0.0
    weight: float = 0.0

    def update(self, stats: GradStats | None) -> float | None:
        """Fold in one step; returns B_simple, or None when the step could not measure it."""
        if stats is None:
            return None
        g2, trace = two_batch_estimates(stats)
        self.g2 = self.decay * self.g2 + g2
        self.trace = self.decay * self.trace + trace
        self.weight = self.decay * self.weight + 1.0
        return self.value

    @property
    def value(self) -> float | None:
        """tr(Σ) / |G|²; None before any measurement or while the smoothed |G|² or tr(Σ) is
        not positive (the gradient's mean is not resolved from its noise yet)."""
        if self.weight == 0.0 or self.g2 <= 0.0 or self.trace <= 0.0:
            return None
        return self.trace / self.g2   # the debiasing weights cancel in the ratio

    def state_dict(self) -> dict:
        return {"g2": self.g2, "trace": self.trace, "weight": self.weight}

    def load_state_dict(self, d: dict | None) -> None:
        if d:
            self.g2, self.trace = float(d["g2"]), float(d["trace"])
            self.weight = float(d["weight"])

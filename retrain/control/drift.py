"""Has the machine changed? Two one-sided CUSUMs on standardized log residuals of the USL fit,
over the smoothed throughput at the current p, and the batch sizes to probe when it has.

Pure: no torch, no I/O. A residual is r = log(observed / predicted throughput); it is scaled
by an EMA estimate of the relative noise, clipped, and summed. False-alarm rates and detection
delays: bench/RESULTS.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from retrain.control.usl import UslFit, throughput_ratio

CUSUM_SLACK = 1.0          # drift check: two one-sided CUSUMs on standardized log residuals
CUSUM_LIMIT = 4.0          # alarm threshold (false-alarm rate: bench/RESULTS.md)
CUSUM_Z_MAX = 4.0          # one step adds at most CUSUM_Z_MAX - CUSUM_SLACK (< the limit)
CUSUM_AFTER = 3            # residuals start counting after this many steps at one p
NOISE_FLOOR = 0.02         # smallest relative noise assumed (a perfect simulator has none)
NOISE_PRIOR = 0.05         # relative noise assumed before there are residuals to measure it
NOISE_DECAY = 0.95         # EMA decay of the squared residuals (the noise estimate)
PROBES = 4                 # batch sizes probed after a drift (plus the current one)

Cusum = tuple[float, float, float, float]   # (upward, downward, their run lengths)
NO_DRIFT: Cusum = (0.0, 0.0, 0.0, 0.0)


def initial_noise2(fit: UslFit, points: Sequence[tuple[int, float]]) -> float:
    """Squared relative noise of the points (p, p/X) the fit was made from (a prior for <= 3)."""
    if len(points) <= 3:
        return NOISE_PRIOR**2
    r2 = [min(math.log(throughput_ratio(p / y, fit.throughput(p))) ** 2, 1.0) for p, y in points]
    return max(sum(r2) / (len(points) - 3), NOISE_FLOOR**2)


def cusum_step(cusum: Cusum, noise2: float | None, r: float,
               n_at_p: int) -> tuple[Cusum, float, int, int]:
    """One residual r: (new CUSUM, new noise2, +1 faster | −1 slower | 0, and for how many
    steps the alarming sum has been above zero: the estimated time since the change).

    The noise estimate learns from every residual; the sums only after CUSUM_AFTER steps at
    this concurrency (the EMA is still settling before that)."""
    s = math.sqrt(max(noise2 or NOISE_PRIOR**2, NOISE_FLOOR**2))
    clipped = min(max(r, -4 * s), 4 * s)
    noise2 = NOISE_DECAY * (noise2 or s * s) + (1 - NOISE_DECAY) * clipped**2
    if n_at_p <= CUSUM_AFTER:
        return cusum, noise2, 0, 0
    # Clipped: a single slow step (a checkpoint save, an API hiccup) never alarms alone.
    z = min(max(r / s, -CUSUM_Z_MAX), CUSUM_Z_MAX)
    up, down, up_run, down_run = cusum
    up = max(0.0, up + z - CUSUM_SLACK)
    down = max(0.0, down - z - CUSUM_SLACK)
    up_run, down_run = (up_run + 1 if up else 0.0), (down_run + 1 if down else 0.0)
    cusum = (up, down, up_run, down_run)
    if up > CUSUM_LIMIT:
        return cusum, noise2, 1, int(up_run)
    if down > CUSUM_LIMIT:
        return cusum, noise2, -1, int(down_run)
    return cusum, noise2, 0, 0


@dataclass
class DriftWatch:
    """The throughput at the current p, smoothed, and the CUSUM of its residuals from the fit."""

    ema_p: int = 0                                # the p the EMA is about (0: none yet)
    ema: tuple[float, float] = (0.0, 0.0)         # (weighted sum, weight): debiased EMA
    n_at_p: int = 0                               # observations at ema_p
    cusum: Cusum = NO_DRIFT
    noise2: float | None = None                   # squared relative noise of the throughput

    def add(self, p: int, x: float, decay: float) -> None:
        """Debiased EMA of throughput at p (it restarts, with the CUSUM, when p changes)."""
        if p != self.ema_p:
            self.ema_p, self.ema, self.n_at_p, self.cusum = p, (0.0, 0.0), 0, NO_DRIFT
        s, w = self.ema
        self.ema = (decay * s + x, decay * w + 1.0)
        self.n_at_p += 1

    def value(self) -> float:
        s, w = self.ema
        return s / w

    def check(self, r: float) -> tuple[int, int]:
        """One residual r = log(observed / predicted): (+1 | −1 | 0, steps since the change)."""
        self.cusum, self.noise2, direction, since = cusum_step(self.cusum, self.noise2, r,
                                                               self.n_at_p)
        return direction, since

    def state_dict(self) -> dict:
        return {"ema_p": self.ema_p, "ema": list(self.ema), "n_at_p": self.n_at_p,
                "cusum": list(self.cusum), "noise2": self.noise2}

    @classmethod
    def from_state(cls, d: dict) -> DriftWatch:
        ema, cusum = tuple(map(float, d["ema"])), tuple(map(float, d["cusum"]))
        if len(cusum) != 4 or len(ema) != 2:
            raise ValueError("cusum or ema of the wrong length")
        noise2 = None if d["noise2"] is None else float(d["noise2"])
        return cls(int(d["ema_p"]), (ema[0], ema[1]), int(d["n_at_p"]),
                   (cusum[0], cusum[1], cusum[2], cusum[3]), noise2)


def probe_sizes(b: int, direction: int, bound: Callable[[int], int]) -> list[int]:
    """After a drift: up to PROBES sizes spanning 16x around b (each through `bound`), starting
    on the side the throughput moved to (faster: larger sizes first)."""
    up, down = (2.0, 4.0, 8.0), (0.5, 0.25, 0.125)
    near, far = (up, down) if direction > 0 else (down, up)
    probes: list[int] = []
    for f in near[:2] + far[:2] + near[2:] + far[2:]:
        c = bound(max(1, round(b * f)))
        if c != b and c not in probes:
            probes.append(c)
    return probes[:PROBES]

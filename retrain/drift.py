"""Has the machine changed? Two one-sided CUSUMs on standardized log residuals of the USL fit.

Pure: no torch, no I/O. A residual is r = log(observed / predicted throughput); it is scaled
by an EMA estimate of the relative noise, clipped, and summed. False-alarm rates and detection
delays: bench/RESULTS.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from retrain.usl import UslFit, throughput_ratio

CUSUM_SLACK = 1.0          # drift check: two one-sided CUSUMs on standardized log residuals
CUSUM_LIMIT = 4.0          # alarm threshold (false-alarm rate: bench/RESULTS.md)
CUSUM_Z_MAX = 4.0          # one step adds at most CUSUM_Z_MAX - CUSUM_SLACK (< the limit)
CUSUM_AFTER = 3            # residuals start counting after this many steps at one p
NOISE_FLOOR = 0.02         # smallest relative noise assumed (a perfect simulator has none)
NOISE_PRIOR = 0.05         # relative noise assumed before there are residuals to measure it
NOISE_DECAY = 0.95         # EMA decay of the squared residuals (the noise estimate)

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

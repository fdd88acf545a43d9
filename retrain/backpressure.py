"""USL back-pressure: fit X(p) = λp / (1 + σ(p−1) + κp(p−1)) to step throughput, pick the batch.

Pure: no torch, no numpy, no I/O. `p = batch_size * group_size` (concurrency), X in tokens/s.
`p / X = a + b p + c p²` is a quadratic, so (σ, κ, λ) come from (weighted) least squares on
running sums over a sliding window (O(1) per step). See docs/backpressure.md.
"""

from __future__ import annotations

import itertools
import math
import numbers
import operator
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache, partial

WINDOW = 100              # observations the fit sees (the oldest leaves when a new one arrives)
MEMORY_BOUND_RATIO = 1.10  # smoothed throughput above the fit's prediction by > 10%
OPTIMAL_FLOOR = 0.80       # ... below 80% of it: the fit no longer describes the machine
CUSUM_SLACK = 1.0          # drift check: two one-sided CUSUMs on standardized log residuals;
CUSUM_LIMIT = 4.0          # pure noise alarms about once per ~10,000 steps, a 2.8-sigma shift in ~3
CUSUM_Z_MAX = 4.0          # one step adds at most CUSUM_Z_MAX - CUSUM_SLACK (< the limit)
CUSUM_AFTER = 3            # residuals start counting after this many steps at one p
NOISE_FLOOR = 0.02         # smallest relative noise assumed (a perfect simulator has none)
NOISE_PRIOR = 0.05         # relative noise assumed before there are residuals to measure it
NOISE_DECAY = 0.95         # EMA decay of the squared residuals (the noise estimate)
REFIT_GROWTH = 0.1         # refit when the window has grown by this fraction since the last fit,
REFIT_MIN = 2              # ... and by at least this many points
PROBES = 4                 # batch sizes probed after a drift (plus the current one)
X_RANGE = (1e-6, 1e12)     # plausible tokens/s; anything outside is rejected as a bad timing
P_MAX = 10**7              # largest concurrency accepted as an observation
LAMBDA_MAX = 1e15          # a fit claiming more tokens/s at p = 1 than this is rejected

ACTIONS = ("hold", "throttle", "increase")
REGIMES = ("warmup", "retrograde", "memory_bound", "compute_bound", "optimal")
METRIC_KEYS = ("bp_action", "bp_regime", "bp_p_star", "bp_sigma", "bp_kappa", "bp_lambda",
               "bp_utilization", "bp_throughput", "bp_p")


# ---------------------------------------------------------------------------- the model


def usl_throughput(p: float, sigma: float, kappa: float, lam: float) -> float:
    """X(p) = λp / (1 + σ(p−1) + κp(p−1)); X(1) = λ."""
    return lam * p / (1.0 + sigma * (p - 1.0) + kappa * p * (p - 1.0))


def usl_p_star(sigma: float, kappa: float) -> float:
    """Concurrency that maximizes X for p >= 1: sqrt((1−σ)/κ); inf when κ <= 0, 1 when σ >= 1."""
    if sigma >= 1.0:
        return 1.0
    if kappa <= 0.0:
        return math.inf
    return max(1.0, math.sqrt((1.0 - sigma) / kappa))


@dataclass(slots=True)
class UslFit:
    """Fitted USL coefficients (σ >= 0, κ >= 0, λ > 0, all finite).

    A value: treat it as read-only (not frozen: frozen construction costs ~2 µs per refit)."""

    sigma: float
    kappa: float
    lam: float
    p_star: float = field(init=False, compare=False)  # derived; read on every step

    def __post_init__(self) -> None:
        self.p_star = usl_p_star(self.sigma, self.kappa)

    def throughput(self, p: float) -> float:
        # usl_throughput's formula, inline: this runs on every step.
        return self.lam * p / (1.0 + self.sigma * (p - 1.0) + self.kappa * p * (p - 1.0))


class UslSums:
    """Sliding-window weighted least squares of y = p/X = a + b p + c p² from running sums.

    Step-time noise is multiplicative, so each point is weighted by 1/y² (it counts by its
    relative error, not by the size of p). For conditioning, the sums use q = (p − center) /
    scale, which maps the batch-size range onto [−1, 1]: Σ w q^k (k = 0..4) and Σ w q^k y
    (k = 0..2), compensated floats, so adding and removing a point is O(1).

    New points reach the sums when the sums are next read, a run of points at one p as one
    update (a controller adds many points at one p between two fits; updating per point was
    a sixth of a step). Once the controller stops refitting, `add(..., track=False)` only
    slides the window: the sums go stale and are rebuilt from the points, exactly, the next
    time anything reads them.
    """

    def __init__(self, window: int = WINDOW, center: float = 0.0, scale: float = 1.0):
        self.window, self.center, self.scale = window, float(center), float(scale)
        self.points: deque[tuple[int, float]] = deque()
        # Σ q^k / y² (k = 0..4) then Σ q^k / y (k = 0..2), each as a compensated
        # (sum, compensation) pair: adding and later subtracting a value leaves ~no drift.
        self.s = [0.0] * 8
        self.c = [0.0] * 8
        self.counts: dict[int, int] = {}
        self.stale = False  # sums and counts no longer describe `points` (see add)
        self.unapplied = 0  # newest points not in the sums and counts yet

    def __len__(self) -> int:
        return len(self.points)

    @property
    def distinct(self) -> int:
        self._refresh()
        return len(self.counts)

    def add(self, p: int, y: float, *, track: bool = True) -> None:
        """Add one observation; the oldest leaves once the window is full. `track=False`
        leaves the sums stale until they are next read."""
        self.stale = self.stale or not track
        points = self.points
        points.append((p, y))
        self.unapplied += 1
        if len(points) > self.window:
            old_p, old_y = points.popleft()
            if self.unapplied > len(points):
                self.unapplied -= 1          # it never reached the sums
            elif not self.stale:
                v = -1.0 / old_y
                self._apply(old_p, v / old_y, v, -1)

    def _refresh(self) -> None:
        if self.stale:
            self.keep_newest(len(self.points))
        if self.unapplied:
            self._catch_up()

    def _catch_up(self) -> None:
        """Apply the unapplied points, one update per run of equal p."""
        k, self.unapplied = self.unapplied, 0
        run_p, w, v, n = 0, 0.0, 0.0, 0
        for p, y in itertools.islice(self.points, len(self.points) - k, None):
            if p != run_p:
                if n:
                    self._apply(run_p, w, v, n)
                run_p, w, v, n = p, 0.0, 0.0, 0
            inv = 1.0 / y
            w, v, n = w + inv / y, v + inv, n + 1
        if n:
            self._apply(run_p, w, v, n)

    def _apply(self, p: int, w: float, v: float, n: int) -> None:
        """Add n points at p with Σ 1/y² = w and Σ 1/y = v (n < 0 and negative sums remove)."""
        q = (p - self.center) / self.scale
        wq, vq = w * q, v * q
        wq2 = wq * q
        wq3 = wq2 * q
        s, c = self.s, self.c
        # Knuth's TwoSum, unrolled (a loop doubles the cost): each add's rounding error goes to c.
        x0, x1, x2, x3, x4, x5, x6, x7 = w, wq, wq2, wq3, wq3 * q, v, vq, vq * q
        a = s[0]; t = a + x0; e = t - a; c[0] += (a - (t - e)) + (x0 - e); s[0] = t  # noqa: E702
        a = s[1]; t = a + x1; e = t - a; c[1] += (a - (t - e)) + (x1 - e); s[1] = t  # noqa: E702
        a = s[2]; t = a + x2; e = t - a; c[2] += (a - (t - e)) + (x2 - e); s[2] = t  # noqa: E702
        a = s[3]; t = a + x3; e = t - a; c[3] += (a - (t - e)) + (x3 - e); s[3] = t  # noqa: E702
        a = s[4]; t = a + x4; e = t - a; c[4] += (a - (t - e)) + (x4 - e); s[4] = t  # noqa: E702
        a = s[5]; t = a + x5; e = t - a; c[5] += (a - (t - e)) + (x5 - e); s[5] = t  # noqa: E702
        a = s[6]; t = a + x6; e = t - a; c[6] += (a - (t - e)) + (x6 - e); s[6] = t  # noqa: E702
        a = s[7]; t = a + x7; e = t - a; c[7] += (a - (t - e)) + (x7 - e); s[7] = t  # noqa: E702
        n += self.counts.get(p, 0)
        if n:
            self.counts[p] = n
        else:
            del self.counts[p]

    def sums(self) -> tuple[list[float], list[float]]:
        """(Σ w q^k for k = 0..4, Σ w q^k y for k = 0..2) with w = 1/y²."""
        totals = self._totals()
        return list(totals[:5]), list(totals[5:])

    def _totals(self) -> tuple[float, ...]:
        self._refresh()
        s, c = self.s, self.c
        return (s[0] + c[0], s[1] + c[1], s[2] + c[2], s[3] + c[3], s[4] + c[4],
                s[5] + c[5], s[6] + c[6], s[7] + c[7])

    def keep_newest(self, k: int) -> None:
        """Forget all but the newest k observations (after the machine changed)."""
        newest = list(self.points)[-k:] if k > 0 else []
        self.__init__(self.window, self.center, self.scale)
        for p, y in newest:
            self.add(p, y)

    def fit(self) -> UslFit | str:
        """Weighted least-squares USL fit with σ, κ >= 0, or the reason there is none."""
        s0, s1, s2, s3, s4, t0, t1, t2 = self._totals()
        if len(self.counts) < 3:
            return f"fewer than 3 distinct concurrencies in the window ({len(self.counts)})"
        a00, a01, a02 = s2 * s4 - s3 * s3, s2 * s3 - s1 * s4, s1 * s3 - s2 * s2
        a11, a12, a22 = s0 * s4 - s2 * s2, s1 * s2 - s0 * s3, s0 * s2 - s1 * s1
        det = s0 * a00 + s1 * a01 + s2 * a02
        if not (math.isfinite(det) and det > 0):
            return "singular least-squares system"
        x0 = (a00 * t0 + a01 * t1 + a02 * t2) / det
        x1 = (a01 * t0 + a11 * t1 + a12 * t2) / det
        x2 = (a02 * t0 + a12 * t1 + a22 * t2) / det
        # One step of iterative refinement: Cramer's rule alone loses digits on wide ranges.
        r0 = t0 - (s0 * x0 + s1 * x1 + s2 * x2)
        r1 = t1 - (s1 * x0 + s2 * x1 + s3 * x2)
        r2 = t2 - (s2 * x0 + s3 * x1 + s4 * x2)
        fit = self._usl(x0 + (a00 * r0 + a01 * r1 + a02 * r2) / det,
                        x1 + (a01 * r0 + a11 * r1 + a12 * r2) / det,
                        x2 + (a02 * r0 + a12 * r1 + a22 * r2) / det)
        if fit is None:
            return "fit gives λ <= 0 or a non-finite coefficient"
        if fit.kappa < 0:                      # refit with κ = 0: y linear in q
            alpha, beta = _solve2(s0, s1, s2, t0, t1)
            fit = self._usl(alpha, beta, 0.0)
        elif fit.sigma < 0:                    # refit with σ = 0: b + c = 0 in p, i.e.
            r = (2 * self.center - 1) / self.scale   # y = α + γ (q² + r q)
            alpha, gamma = _solve2(s0, s2 + r * s1, s4 + 2 * r * s3 + r * r * s2,
                                   t0, t2 + r * t1)
            fit = self._usl(alpha, gamma * r, gamma)
            fit = UslFit(0.0, fit.kappa, fit.lam) if fit is not None else None
        if fit is not None and (fit.sigma < 0 or fit.kappa < 0):
            fit = self._usl(t0 / s0, 0.0, 0.0)  # σ = κ = 0: X = λp
        return fit if fit is not None else "constrained fit gives λ <= 0"

    def _usl(self, alpha: float, beta: float, gamma: float) -> UslFit | None:
        """y = α + β q + γ q² (q = (p − center)/scale)  ->  λ = 1/y(1), σ = (b+c)λ, κ = cλ,
        where b and c are the p and p² coefficients. None if that is not a valid USL."""
        sc = self.scale
        q1 = (1.0 - self.center) / sc
        inv_lam = alpha + beta * q1 + gamma * q1 * q1
        if not (math.isfinite(inv_lam) and inv_lam > 1.0 / LAMBDA_MAX):
            return None
        lam = 1.0 / inv_lam
        b_plus_c = (beta + gamma * (1.0 - 2.0 * self.center) / sc) / sc
        fit = UslFit(sigma=b_plus_c * lam, kappa=gamma / (sc * sc) * lam, lam=lam)
        return fit if math.isfinite(fit.sigma) and math.isfinite(fit.kappa) else None

    def recompute(self) -> tuple[list[float], list[float]]:
        """`sums()` from scratch, exactly rounded (for checks)."""
        qs = [((p - self.center) / self.scale, y) for p, y in self.points]
        w = [math.fsum(q**k / (y * y) for q, y in qs) for k in range(5)]
        v = [math.fsum(q**k / y for q, y in qs) for k in range(3)]
        return w, v

    def state_dict(self) -> dict:
        return {"center": self.center, "scale": self.scale,
                "points": [[p, y] for p, y in self.points],
                "sums": [list(sc) for sc in zip(self.s, self.c, strict=True)],
                "stale": self.stale, "unapplied": self.unapplied}

    def load_state_dict(self, d: dict) -> None:
        self.__init__(self.window, float(d["center"]), float(d["scale"]))
        points = d["points"][-self.window:]
        self.unapplied = int(d.get("unapplied", 0))   # absent before 2026-11-23: 0
        if not 0 <= self.unapplied <= len(points):
            raise ValueError("malformed unapplied count")
        for i, (p, y) in enumerate(points):
            self.points.append((int(p), float(y)))
            if i < len(points) - self.unapplied:
                self.counts[int(p)] = self.counts.get(int(p), 0) + 1
        # Restore the float sums bit for bit so a resumed run takes the very same decisions.
        self.s = [float(s) for s, _ in d["sums"]]
        self.c = [float(c) for _, c in d["sums"]]
        self.stale = bool(d.get("stale", False))
        if len(self.s) != 8 or not self.scale > 0:
            raise ValueError("malformed sums")


def _solve2(m00: float, m01: float, m11: float, r0: float, r1: float) -> tuple[float, float]:
    """Solve the 2x2 normal equations [[m00, m01], [m01, m11]] x = r (nan if singular)."""
    det = m00 * m11 - m01 * m01
    if not (math.isfinite(det) and det > 0):
        return math.nan, math.nan
    return (m11 * r0 - m01 * r1) / det, (m00 * r1 - m01 * r0) / det


# ---------------------------------------------------------------------------- roofline


@dataclass(frozen=True)
class Roofline:
    """One step placed on the roofline: intensity in FLOP/byte, fractions of each peak."""

    intensity: float         # FLOP per byte moved
    balance: float           # machine balance: peak FLOP/s / peak byte/s (FLOP per byte)
    compute_fraction: float  # achieved FLOP/s / peak FLOP/s
    memory_fraction: float   # achieved byte/s / peak byte/s

    @property
    def regime(self) -> str:
        # intensity >= balance  <=>  compute_fraction >= memory_fraction (same comparison).
        return "compute_bound" if self.intensity >= self.balance else "memory_bound"


def roofline(flops: float | None, bytes_moved: float | None, step_time_s: float,
             peak_gflops: float, peak_bw_gb_s: float) -> Roofline | None:
    """Place a step on the roofline, or None without hints (or with unusable ones)."""
    if flops is None or bytes_moved is None or not peak_gflops or not peak_bw_gb_s:
        return None                         # no hints: the usual case, decided cheaply
    vals = (flops, bytes_moved, step_time_s, peak_gflops, peak_bw_gb_s)
    if not all(_positive(v) for v in vals):
        return None
    flops, bytes_moved, step_time_s = float(flops), float(bytes_moved), float(step_time_s)
    peak_flops = peak_gflops * 1e9          # GFLOP/s -> FLOP/s
    peak_bytes = peak_bw_gb_s * 1e9         # GB/s -> byte/s
    r = Roofline(intensity=flops / bytes_moved, balance=peak_flops / peak_bytes,
                 compute_fraction=flops / step_time_s / peak_flops,
                 memory_fraction=bytes_moved / step_time_s / peak_bytes)
    return r if all(math.isfinite(v) for v in (r.intensity, r.balance, r.compute_fraction,
                                               r.memory_fraction)) else None


_LARGEST_FLOAT_INT = int(sys.float_info.max)


def _positive(v: object) -> bool:
    """A finite number > 0 (numpy scalars included, booleans not)."""
    if type(v) is float:                    # the common cases, without the ABC check
        return 0.0 < v < math.inf
    if type(v) is int:
        return 0 < v <= _LARGEST_FLOAT_INT     # float(v) would overflow above it
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        return False
    try:
        f = float(v)
    except (OverflowError, ValueError):
        return False
    return math.isfinite(f) and f > 0


# ---------------------------------------------------------------------------- decisions


def _ratio(a: float, b: float) -> float:
    """a / b for a >= 0, with b <= 0 (an underflowed prediction) read as infinitely small."""
    return a / b if b > 0 else math.inf


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


class Decision:
    """What the controller concluded from one step; `batch_size` is for the next step.

    A value: treat it as read-only. `reason` is formatted when first read (the controller
    passes a function): formatting it on every step cost a tenth of the per-step budget."""

    __slots__ = ("action", "regime", "batch_size", "p", "p_star", "sigma", "kappa", "lam",
                 "utilization", "throughput", "_reason")
    _FIELDS = __slots__[:-1] + ("reason",)

    def __init__(self, action: str, regime: str, batch_size: int, p: int = 0,
                 p_star: float | None = None, sigma: float | None = None,
                 kappa: float | None = None, lam: float | None = None,
                 utilization: float | None = None, throughput: float | None = None,
                 reason: str | Callable[[], str] = ""):
        self.action = action            # hold | throttle | increase
        self.regime = regime            # warmup | retrograde | memory_bound | compute_bound | ...
        self.batch_size = batch_size
        self.p = p                      # concurrency of the observed step
        self.p_star = p_star            # None = no fit yet; inf = no finite optimum (κ = 0)
        self.sigma = sigma
        self.kappa = kappa
        self.lam = lam                  # tokens/s at p = 1
        self.utilization = utilization  # smoothed throughput / fitted peak within the bounds
        self.throughput = throughput    # EMA-smoothed tokens/s at the current p
        self._reason = reason

    @property
    def reason(self) -> str:
        """Why the controller decided this, in words."""
        r = self._reason
        if not isinstance(r, str):
            r = self._reason = r()
        return r

    def _values(self) -> tuple:
        return tuple(getattr(self, k) for k in self._FIELDS)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Decision):
            return NotImplemented
        return self._values() == other._values()

    __hash__ = None  # type: ignore[assignment]  # mutable value, like the dataclass it was

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in zip(self._FIELDS, self._values(), strict=True))
        return f"Decision({inner})"

    def metrics(self) -> dict:
        """The bp_* keys for metrics.jsonl (finite numbers or None; {} when disabled)."""
        if self.regime == "disabled":
            return {}
        return {"bp_action": self.action, "bp_regime": self.regime,
                "bp_p_star": _finite(self.p_star), "bp_sigma": _finite(self.sigma),
                "bp_kappa": _finite(self.kappa), "bp_lambda": _finite(self.lam),
                "bp_utilization": _finite(self.utilization),
                "bp_throughput": _finite(self.throughput), "bp_p": self.p}


def sweep_sizes(lo: int, hi: int) -> list[int]:
    """Warm-up batch sizes: lo, 2lo, 4lo, ... up to hi, then the geometric midpoints."""
    return list(_sweep(lo, hi))


@lru_cache(maxsize=16)
def _sweep(lo: int, hi: int) -> tuple[int, ...]:
    # Cached: building it took a fifth of an exploring step.
    first, b = [], lo
    while b < hi:
        first.append(b)
        b *= 2
    first.append(hi)
    mids = {round(math.sqrt(x * y)) for x, y in zip(first, first[1:], strict=False)}
    return tuple(first + sorted(mids - set(first)))


def _as_batch(v: object) -> int | None:
    try:
        b = operator.index(v)
    except TypeError:
        return None
    return b if b >= 1 and not isinstance(v, bool) else None


def _throughput(tokens: object, step_time_s: object) -> float | str:
    """tokens / step_time_s, or why the pair is unusable."""
    if not _positive(tokens):
        return f"tokens={tokens!r} is not a positive finite number"
    if not _positive(step_time_s):
        return f"step_time_s={step_time_s!r} is not a positive finite number"
    x = float(tokens) / float(step_time_s)
    if not (X_RANGE[0] <= x <= X_RANGE[1]):
        return f"throughput {x:.3g} tokens/s is outside the plausible {X_RANGE}"
    return x


class BackpressureController:
    """Observes each step's throughput and proposes the next batch size (whole prompts)."""

    def __init__(self, config, group_size: int):
        g = _as_batch(group_size)
        if g is None:
            raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
        self.config = config
        self.group_size = g
        self.enabled = bool(config.enabled)
        self.lo = max(1, int(config.min_batch_size))
        self.hi = max(self.lo, int(config.max_batch_size))
        self._tm, self._im = config.throttle_margin, config.increase_margin
        self._ema_decay = config.ema_decay
        self._reset()

    def _reset(self) -> None:
        lo_p, hi_p = self.lo * self.group_size, self.hi * self.group_size
        self._sums = UslSums(WINDOW, (lo_p + hi_p) / 2, max((hi_p - lo_p) / 2, 1.0))
        self._fit: UslFit | None = None
        self._derived: _Derived | None = None  # from the fit and the ceiling; None = stale
        self._steps = 0                    # valid observations so far
        self._ceiling: int | None = None   # smallest batch size that ran out of memory
        self._ok_max: int | None = None    # largest batch size that ran below the ceiling
        self._exploring = True
        self._explore_n = 0                # observations in the current exploration
        self._explore_len = self.config.warmup_steps + 1
        self._retries = 0                  # out-of-memory retries in this exploration
        self._probes: list[int] = []       # empty = the warm-up sweep
        self._refit_left = 0               # steps before exploration points leave the window
        self._refit_at = 0                 # window size at which the next refit happens
        self._approaching = False          # the last increase was cut short by the bisection
        self._ema_p = 0
        self._ema = (0.0, 0.0)             # (weighted sum, weight): debiased EMA
        self._n_at_p = 0
        self._cusum = _NO_DRIFT            # (upward, downward, their run lengths)
        self._noise2: float | None = None
        self._regime = "warmup"
        self._next: int | None = None      # the last proposed batch size
        self._note = ""

    # ------------------------------------------------------------------ public interface

    def first_batch_size(self, configured: int) -> int:
        """Batch size of step 1: the warm-up start when enabled, else `configured`."""
        if not self.enabled:
            return configured
        if self._next is not None:
            return self._next
        return self._plan() if self._exploring else self._bound(configured)

    def observe(self, batch_size: int, tokens: float, step_time_s: float, *, oom: bool = False,
                flops: float | None = None, bytes_moved: float | None = None) -> Decision:
        """Record one step (or an out-of-memory failure) and decide the next batch size."""
        if not self.enabled:
            return Decision("hold", "disabled", batch_size)
        b = _as_batch(batch_size)
        if b is None or b * self.group_size > P_MAX:
            return self._reject(self.lo, 0, f"batch_size={batch_size!r} is not usable")
        if oom:
            return self._out_of_memory(b)
        x = _throughput(tokens, step_time_s)
        p = b * self.group_size
        if isinstance(x, str):
            return self._reject(b, p, x)
        roof = None if flops is None else roofline(flops, bytes_moved, step_time_s,
                                                   self.config.peak_gflops,
                                                   self.config.peak_bw_gb_s)
        self._steps += 1
        if (self._ceiling is None or b < self._ceiling) and b > (self._ok_max or 0):
            self._ok_max = b
        predicted = self._fit.throughput(p) if self._fit and not self._exploring else None
        self._smooth(p, x)
        # Sums are read only by fits: while exploring and until the window has refilled.
        self._sums.add(p, p / x, track=self._exploring or self._refit_left > 0)
        if self._exploring:
            return self._explore(b, p, roof)
        return self._track(b, p, x, predicted, roof)

    def state_dict(self) -> dict:
        """Everything needed to continue with the same fit and decisions (JSON-able)."""
        if not self.enabled:
            return {}
        fit = self._fit
        return {"version": 1, "group_size": self.group_size, "steps": self._steps,
                "sums": self._sums.state_dict(),
                "fit": [fit.sigma, fit.kappa, fit.lam] if fit else None,
                "ceiling": self._ceiling, "ok_max": self._ok_max,
                "exploring": self._exploring, "explore_n": self._explore_n,
                "explore_len": self._explore_len, "retries": self._retries,
                "probes": list(self._probes),
                "refit_left": self._refit_left, "refit_at": self._refit_at,
                "approaching": self._approaching, "ema_p": self._ema_p, "ema": list(self._ema),
                "n_at_p": self._n_at_p, "cusum": list(self._cusum), "noise2": self._noise2,
                "regime": self._regime, "next": self._next}

    def load_state_dict(self, d: dict) -> bool:
        """Continue from `state_dict()`; a missing, foreign or broken state starts fresh."""
        if not self.enabled:
            return False
        self._reset()
        if not d or d.get("version") != 1 or d.get("group_size") != self.group_size:
            self._note = "no usable saved controller state: starting a fresh warm-up"
            return False
        try:
            self._sums.load_state_dict(d["sums"])
            self._fit = UslFit(*map(float, d["fit"])) if d["fit"] else None
            self._steps = int(d["steps"])
            self._ceiling = None if d["ceiling"] is None else int(d["ceiling"])
            self._ok_max = None if d["ok_max"] is None else int(d["ok_max"])
            self._next = None if d["next"] is None else int(d["next"])
            self._exploring = bool(d["exploring"])
            self._explore_n, self._explore_len = int(d["explore_n"]), int(d["explore_len"])
            self._retries = int(d["retries"])
            self._probes = [int(v) for v in d["probes"]]
            self._refit_left = int(d["refit_left"])
            self._refit_at = int(d.get("refit_at", 0))   # absent before 2026-11-23
            self._approaching = bool(d.get("approaching", False))
            self._ema_p, self._ema = int(d["ema_p"]), tuple(map(float, d["ema"]))
            self._n_at_p, self._cusum = int(d["n_at_p"]), tuple(map(float, d["cusum"]))
            if len(self._cusum) != 4:
                raise ValueError("cusum")
            self._noise2 = None if d["noise2"] is None else float(d["noise2"])
            self._regime = str(d["regime"])
        except (KeyError, TypeError, ValueError) as exc:
            self._reset()
            self._note = f"saved controller state is broken ({exc!r}): starting a fresh warm-up"
            return False
        return True

    # ------------------------------------------------------------------ bounds

    @property
    def cap(self) -> int:
        """Largest batch size the controller may propose (bounds and out-of-memory ceiling)."""
        if self._ceiling is None:
            return self.hi
        return max(self.lo, min(self.hi, self._ceiling - 1))

    def _bound(self, b: int) -> int:
        if self._ceiling is None:          # the usual case, without the calls below
            return self.lo if b < self.lo else self.hi if b > self.hi else b
        if self.lo <= b <= (self._ok_max or 0) and b <= self.hi:
            return b                       # ran below the ceiling: the usual case under one
        b = min(max(b, self.lo), self.cap)
        if b > (self._ok_max or 0):
            # Untested sizes under an out-of-memory ceiling are approached by bisection.
            known = self._ok_max or self.lo - 1
            b = min(b, max(known + 1, (known + self._ceiling) // 2, self.lo))
        return b

    def _plan(self) -> int:
        """The next exploration size (an out-of-memory retry does not use up a planned size)."""
        n = self._explore_n - self._retries
        if self._probes:
            return self._bound(self._probes[min(n, len(self._probes) - 1)])
        sizes = _sweep(self.lo, self.cap)
        return self._bound(sizes[n % len(sizes)])

    # ------------------------------------------------------------------ observation kinds

    def _decision(self, action: str, regime: str, b_next: int, p: int,
                  reason: str | Callable[[], str], ema: float | None = None,
                  derived: _Derived | None = None) -> Decision:
        self._regime, self._next = regime, b_next
        fit, note = self._fit, self._note
        if note:
            self._note = ""
            reason = _joined(note, reason)
        if ema is None and self._ema_p:
            ema = self._ema_value()
        if fit is None:
            return Decision(action, regime, b_next, p=p, throughput=ema, reason=reason)
        util = None if ema is None else _ratio(ema, (derived or self._derive()).peak_x)
        return Decision(action, regime, b_next, p, fit.p_star, fit.sigma, fit.kappa, fit.lam,
                        util, ema, reason)

    def _reject(self, b: int, p: int, why: str) -> Decision:
        nxt = self._bound(b)
        return self._decision(_action(b, nxt), self._regime, nxt, p,
                              f"observation rejected: {why}; holding")

    def _out_of_memory(self, b: int) -> Decision:
        self._ceiling = b if self._ceiling is None else min(self._ceiling, b)
        self._derived, self._approaching = None, False
        if self._ok_max is not None and self._ok_max >= self._ceiling:
            self._ok_max = None          # a size that once fit no longer does
        retry = self._bound(self._ok_max if self._ok_max else b // 2)
        if self._exploring:
            self._retries += 1
            self._explore_len += 1
        why = f"out of memory at batch_size {b}: never proposing {self._ceiling} or more"
        if b <= self.lo:
            why = f"out of memory at min_batch_size ({self.lo}): cannot go lower"
        return self._decision(_action(b, retry), self._regime, retry, b * self.group_size, why)

    def _explore(self, b: int, p: int, roof: Roofline | None) -> Decision:
        self._explore_n += 1
        if self._explore_n < self._explore_len:
            nxt = self._plan()
            return self._decision("hold", "warmup", nxt, p,
                                  f"exploring ({self._explore_n}/{self._explore_len - 1})")
        fit = self._sums.fit()
        if isinstance(fit, str):
            if self.cap - self.lo < 2:
                return self._decision("hold", "warmup", self._bound(b), p,
                                      f"batch size range allows fewer than 3 sizes: {fit}")
            self._probes = []        # keep sweeping until the data support a fit
            self._explore_len += 1
            nxt = self._plan()
            return self._decision("hold", "warmup", nxt, p, f"exploring further: {fit}")
        self._fit, self._derived = fit, None
        self._exploring = False
        self._probes = []
        self._refit_left = self._sums.window - len(self._sums)
        self._refit_at = len(self._sums) + 1
        self._cusum = _NO_DRIFT
        if self._noise2 is None:
            self._noise2 = self._initial_noise2(fit)
        return self._decide(b, p, roof, "first fit after exploring", first=True)

    def _track(self, b: int, p: int, x: float, predicted: float | None,
               roof: Roofline | None) -> Decision:
        note, fit_before = "", self._fit
        if self._refit_left > 0:
            self._refit_left -= 1
            n = len(self._sums)
            if n >= self._refit_at:
                # A new point moves a fit of n points by ~1/n: refitting once the window has
                # grown by REFIT_GROWTH follows the fit closely at a fraction of the cost.
                self._refit_at = n + max(REFIT_MIN, int(n * REFIT_GROWTH))
                fit = self._sums.fit()
                if isinstance(fit, str):
                    note = f"keeping the previous fit ({fit})"
                else:
                    self._fit, self._derived = fit, None
        drift, run = self._drift(math.log(_ratio(x, predicted))) if predicted else (0, 0)
        if drift:
            return self._start_probe(b, p, drift, run)
        unchanged = self._fit is fit_before   # then `predicted` is the fit's value at p
        return self._decide(b, p, roof, note, predicted=predicted if unchanged else None)

    # ------------------------------------------------------------------ the regime table

    def _decide(self, b: int, p: int, roof: Roofline | None, note: str,
                first: bool = False, predicted: float | None = None) -> Decision:
        """The seed's regime table. `first`: the decision right after exploring, which always
        goes to the target (an exploration size is not an operating point worth holding)."""
        fit, d = self._fit, self._derive()
        assert fit is not None
        ema = self._ema_value()
        ratio = _ratio(ema, predicted or fit.throughput(p))
        if fit.kappa > 0 and p > d.retrograde_p:
            regime, nxt, rule = "retrograde", d.target, "retrograde"
        else:
            if roof is not None:
                regime = roof.regime
            elif ratio > MEMORY_BOUND_RATIO:
                regime = "memory_bound"
            elif ratio >= OPTIMAL_FLOOR:
                regime = "optimal"
            else:
                regime = "warmup"
            if first:
                nxt, rule = d.target, "first"
            elif regime == "warmup":
                nxt, rule = b, "overestimates"
            elif p < d.increase_p:
                nxt, rule = d.target, "below"
            elif self._approaching and d.target > b:
                nxt, rule = d.target, "approaching"
            else:
                nxt, rule = b, ""
        moved, wanted = nxt != b, nxt
        nxt = self._bound(nxt)
        # Under an out-of-memory ceiling an increase goes by bisection; keep going on the next
        # steps (the hysteresis alone would stop it halfway).
        self._approaching = b < nxt < wanted
        action = "hold" if regime == "warmup" else _action(b, nxt)
        # A partial, not a closure: closure cells slowed every line of this method.
        reason = partial(_explain, rule, p, fit.p_star, ratio, self._tm, self._im,
                         moved and nxt == b, roof, note)
        return self._decision(action, regime, nxt, p, reason, ema, d)

    def _derive(self) -> _Derived:
        """What the decisions need from the fit and the bounds, computed once per fit."""
        d = self._derived
        if d is None:
            fit = self._fit
            assert fit is not None
            p_star, tm, g, cap = fit.p_star, self._tm, self.group_size, self.cap
            # Conditionals, not min()/max(): builtin calls made this a fifth of a refit.
            peak_p = cap * g if p_star > cap * g else self.lo * g if p_star < self.lo * g \
                else p_star
            d = self._derived = _Derived(self._target(p_star, cap), tm * p_star,
                                         self._im * tm * p_star, fit.throughput(peak_p))
        return d

    def _target(self, p_star: float, cap: int) -> int:
        """throttle_margin * p* in whole prompts (rounded down), within [lo, cap]."""
        goal = self._tm * p_star / self.group_size
        if goal >= cap:                     # inf included
            return cap
        b = int(goal)
        return self.lo if b < self.lo else b

    # ------------------------------------------------------------------ smoothing and drift

    def _smooth(self, p: int, x: float) -> None:
        """Debiased EMA of throughput at the current p (restarts when p changes)."""
        if p != self._ema_p:
            self._ema_p, self._ema, self._n_at_p = p, (0.0, 0.0), 0
            self._cusum = _NO_DRIFT
        d = self._ema_decay
        s, w = self._ema
        self._ema = (d * s + x, d * w + 1.0)
        self._n_at_p += 1

    def _ema_value(self) -> float:
        s, w = self._ema
        return s / w

    def _initial_noise2(self, fit: UslFit) -> float:
        pts = self._sums.points
        if len(pts) <= 3:
            return NOISE_PRIOR**2
        r2 = [min(math.log(_ratio(p / y, fit.throughput(p))) ** 2, 1.0) for p, y in pts]
        return max(sum(r2) / (len(pts) - 3), NOISE_FLOOR**2)

    def _drift(self, r: float) -> tuple[int, int]:
        """CUSUM on r = log(observed / predicted): (+1 faster | −1 slower | 0, and for how many
        steps the alarming sum has been above zero: the estimated time since the change)."""
        # Written without max()/min() calls (a sixth of a steady-state step); same values.
        n2 = self._noise2 or _NOISE_PRIOR2
        s = math.sqrt(n2 if n2 >= _NOISE_FLOOR2 else _NOISE_FLOOR2)
        lim = 4 * s
        clipped = lim if r > lim else -lim if r < -lim else r
        self._noise2 = NOISE_DECAY * (self._noise2 or s * s) + _NOISE_NEW * clipped**2
        if self._n_at_p <= CUSUM_AFTER:
            return 0, 0
        z = r / s
        # Clipped: a single slow step (a checkpoint save, an API hiccup) never alarms alone.
        z = CUSUM_Z_MAX if z > CUSUM_Z_MAX else -CUSUM_Z_MAX if z < -CUSUM_Z_MAX else z
        up, down, up_run, down_run = self._cusum
        up, down = up + z - CUSUM_SLACK, down - z - CUSUM_SLACK
        up = up if up > 0.0 else 0.0          # max(0.0, up), NaN included
        down = down if down > 0.0 else 0.0
        up_run, down_run = (up_run + 1 if up else 0), (down_run + 1 if down else 0)
        self._cusum = (up, down, up_run, down_run)
        if up > CUSUM_LIMIT:
            return 1, int(up_run)
        return (-1, int(down_run)) if down > CUSUM_LIMIT else (0, 0)

    def _start_probe(self, b: int, p: int, direction: int, since: int) -> Decision:
        """The machine changed: forget old data, probe 4 sizes spanning 16x, starting on the side
        the throughput moved to (faster: larger sizes first)."""
        up, down = (2.0, 4.0, 8.0), (0.5, 0.25, 0.125)
        factors = up[:2] + down[:2] + up[2:] + down[2:] if direction > 0 else \
            down[:2] + up[:2] + down[2:] + up[2:]
        probes: list[int] = []
        for f in factors:
            c = self._bound(max(1, round(b * f)))
            if c != b and c not in probes:
                probes.append(c)
        self._probes = probes[:PROBES]
        self._sums.keep_newest(min(since, self._n_at_p))   # only data from the new machine
        self._exploring, self._approaching = True, False
        self._explore_n, self._explore_len, self._retries = 0, len(self._probes), 0
        self._cusum = _NO_DRIFT
        word = "faster" if direction > 0 else "slower"
        nxt = self._plan() if self._probes else b
        return self._decision("hold", "warmup", nxt, p,
                              f"throughput drifted {word} than the fit at p={p}: re-exploring")


_NO_DRIFT = (0.0, 0.0, 0.0, 0.0)
_NOISE_PRIOR2, _NOISE_FLOOR2, _NOISE_NEW = NOISE_PRIOR**2, NOISE_FLOOR**2, 1 - NOISE_DECAY


@dataclass(slots=True)
class _Derived:
    """Per-fit constants of the regime table (recomputed when the fit or the ceiling changes)."""

    target: int            # throttle_margin * p* in whole prompts, within the bounds
    retrograde_p: float    # throttle_margin * p*
    increase_p: float      # increase_margin * throttle_margin * p*
    peak_x: float          # fitted throughput at the best p within the bounds


def _joined(note: str, reason: str | Callable[[], str]) -> str | Callable[[], str]:
    if isinstance(reason, str):
        return f"{note}; {reason}"
    return lambda: f"{note}; {reason()}"


def _explain(rule: str, p: int, p_star: float, ratio: float, tm: float, im: float,
             at_bound: bool, roof: Roofline | None, note: str) -> str:
    """The words for one regime-table decision (formatted only when someone reads them)."""
    where = f"p={p}, p*={p_star:.4g}, throughput {ratio:.0%} of the fit"
    why = {"retrograde": f"p > {tm} * p* ({where})",
           "first": f"moving to {tm} * p* after exploring ({where})",
           "overestimates": f"fit overestimates this point ({where}): holding",
           "below": f"below target: p < {im} * {tm} * p* ({where})",
           "approaching": f"approaching {tm} * p* below the out-of-memory ceiling ({where})",
           }.get(rule, where)
    if at_bound:
        why += " (at a batch size bound)"
    if roof is not None:
        why += (f"; roofline: {roof.intensity:.3g} FLOP/B vs balance {roof.balance:.3g}, "
                f"{roof.compute_fraction:.0%} of peak FLOP/s, "
                f"{roof.memory_fraction:.0%} of peak bandwidth")
    return f"{note}; {why}" if note else why


def _action(b: int, nxt: int) -> str:
    return "throttle" if nxt < b else "increase" if nxt > b else "hold"

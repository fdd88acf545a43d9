"""The Universal Scalability Law: X(p) = λp / (1 + σ(p−1) + κp(p−1)), and its fit to steps.

Pure: no torch, no numpy, no I/O. p is concurrency (sequences in flight), X tokens/s.
`p / X = a + b p + c p²` is a quadratic, so (σ, κ, λ) come from weighted least squares.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from retrain.control.roofline import is_positive

WINDOW = 100               # observations the fit sees (the oldest leaves when a new one arrives)
LAMBDA_MAX = 1e15          # a fit claiming more tokens/s at p = 1 than this is rejected
X_RANGE = (1e-6, 1e12)     # plausible tokens/s; anything outside is rejected as a bad timing
SLOW_OUTLIER = 1.5         # a point this much slower than the first fit keeps its own weight


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


def throughput_ratio(observed: float, predicted: float) -> float:
    """observed / predicted (observed >= 0); a predicted <= 0 (underflowed) counts as tiny."""
    return observed / predicted if predicted > 0 else math.inf


def observed_throughput(tokens: object, step_time_s: object) -> float | str:
    """tokens / step_time_s, or why the pair is unusable."""
    if not is_positive(tokens):
        return f"tokens={tokens!r} is not a positive finite number"
    if not is_positive(step_time_s):
        return f"step_time_s={step_time_s!r} is not a positive finite number"
    x = float(tokens) / float(step_time_s)
    if not (X_RANGE[0] <= x <= X_RANGE[1]):
        return f"throughput {x:.3g} tokens/s is outside the plausible {X_RANGE}"
    return x


def doubling_sizes(lo: int, hi: int) -> list[int]:
    """lo, 2lo, 4lo, ... up to hi (hi itself last)."""
    first, b = [], lo
    while b < hi:
        first.append(b)
        b *= 2
    return first + [hi]


def sweep_sizes(lo: int, hi: int) -> list[int]:
    """Warm-up batch sizes: lo, 2lo, 4lo, ... up to hi, then the geometric midpoints."""
    first = doubling_sizes(lo, hi)
    mids = {round(math.sqrt(x * y)) for x, y in zip(first, first[1:], strict=False)}
    return first + sorted(mids - set(first))


@dataclass(frozen=True)
class UslFit:
    """Fitted USL coefficients (σ >= 0, κ >= 0, λ > 0, all finite)."""

    sigma: float
    kappa: float
    lam: float

    @property
    def p_star(self) -> float:
        return usl_p_star(self.sigma, self.kappa)

    def throughput(self, p: float) -> float:
        return usl_throughput(p, self.sigma, self.kappa, self.lam)


class UslSums:
    """Weighted least squares of y = p/X = a + b p + c p² over a sliding window of points.

    Step-time noise is multiplicative, so each point is weighted by 1/y² (it counts by its
    relative error). For conditioning, p is mapped to q = (p − center) / scale, which puts the
    batch-size range onto [−1, 1]. The sums are recomputed from the window at each fit: at most
    WINDOW points, exactly rounded (math.fsum), so nothing drifts and a resumed run refits
    from the same points to the same bits.
    """

    def __init__(self, window: int = WINDOW, center: float = 0.0, scale: float = 1.0):
        self.window, self.center, self.scale = window, float(center), float(scale)
        self.points: deque[tuple[int, float]] = deque(maxlen=window)

    def __len__(self) -> int:
        return len(self.points)

    @property
    def distinct(self) -> int:
        return len({p for p, _ in self.points})

    def add(self, p: int, y: float) -> None:
        """Add one observation; the oldest leaves once the window is full."""
        self.points.append((p, y))

    def keep_newest(self, k: int) -> None:
        """Forget all but the newest k observations (after the machine changed)."""
        newest = list(self.points)[-k:] if k > 0 else []
        self.points = deque(newest, maxlen=self.window)

    def _newest_by_p(self, newest: int) -> dict[int, list[tuple[int, float]]]:
        """The newest `newest` points as {p: [(index in the window, y), ...]}."""
        by_p: dict[int, list[tuple[int, float]]] = {}
        start = max(0, len(self.points) - newest)
        for i, (p, y) in enumerate(list(self.points)[start:], start):
            by_p.setdefault(p, []).append((i, y))
        return by_p

    def disagreeing(self, newest: int, factor: float) -> list[int]:
        """The p's with exactly two of the newest points, one more than `factor` times the
        other (which one is the transient takes a third sample to tell)."""
        return [p for p, pts in self._newest_by_p(newest).items() if len(pts) == 2
                and max(y for _, y in pts) > factor * min(y for _, y in pts)]

    def drop_transients(self, newest: int, factor: float) -> int:
        """Among the newest points, drop those more than `factor` off the median of their p
        (for p's with three or more of them); returns how many were dropped."""
        drop = set()
        for pts in self._newest_by_p(newest).values():
            if len(pts) >= 3:
                med = statistics.median(y for _, y in pts)
                drop |= {i for i, y in pts if not med / factor <= y <= med * factor}
        kept = [pt for i, pt in enumerate(self.points) if i not in drop]
        self.points = deque(kept, maxlen=self.window)
        return len(drop)

    def sums(self, fitted: UslFit | None = None) -> tuple[list[float], list[float]]:
        """(Σ w q^k for k = 0..4, Σ w q^k y for k = 0..2) with w = 1/r², where r is the
        point's own y, or with a previous fit its fitted y (see `_weight_base`)."""
        qs = [((p - self.center) / self.scale, y, _weight_base(p, y, fitted))
              for p, y in self.points]
        w = [math.fsum(q**k / (r * r) for q, _, r in qs) for k in range(5)]
        v = [math.fsum(q**k * y / (r * r) for q, y, r in qs) for k in range(3)]
        return w, v

    def fit(self) -> UslFit | str:
        """Weighted least-squares USL fit with σ, κ >= 0, or the reason there is none.

        Step-time noise is multiplicative, so a point counts by its relative error. Weighting
        by the point's own y favours the points that happened to be fast, so the fit is done
        twice, the second time weighted by the first fit's y (iteratively reweighted); an
        outlying slow step, a checkpoint save or a hiccup, still counts by its own y: little."""
        if self.distinct < 3:
            return f"fewer than 3 distinct concurrencies in the window ({self.distinct})"
        first = self._fit_weighted(None)
        if isinstance(first, str):
            return first
        second = self._fit_weighted(first)
        return first if isinstance(second, str) else second

    def log_p_star_se(self, fit: UslFit) -> float | None:
        """Standard error of log p* of `fit`, made from these points (0.1 = ±10%), or None
        without a finite p* > 1 or when the points cannot tell (see `_variance`).

        p* = sqrt(A / C) for y = A + B p + C p², so this is the delta method; it takes the
        fitted coefficients as the truth's, so a fit far off (a fluke of the data) can claim a
        precision the data do not have (under an out-of-memory ceiling far below p*: ±20%
        where the Cramér-Rao bound at the true curve is ±130%)."""
        if not (fit.kappa > 0 and fit.p_star > 1):
            return None
        c0, sc = self.center, self.scale
        big_a, big_c = (1.0 - fit.sigma) / fit.lam, fit.kappa / fit.lam
        # d log p* / d(a, b, c) for y = a + b q + c q², q = (p - c0) / sc
        grad = [0.5 / big_a, -0.5 * c0 / sc / big_a,
                0.5 * (c0 * c0 / big_a - 1.0 / big_c) / (sc * sc)]
        var = self._variance(fit, grad)
        return None if var is None else math.sqrt(var)

    def rejects_p_star_at_least(self, fit: UslFit, p_min: float, z: float) -> bool:
        """Do these points reject "p* >= p_min" against `fit` (a fit of them with p* < p_min),
        by more than z standard errors (a likelihood-ratio test: Δ residual / s² > z²)?

        Under that hypothesis the best fits have p* = p_min exactly (y = B p + C (p_min² +
        p²), since p*² = A / C) or no peak at all (y = A + B p); both are weighted least
        squares with the fit's second-pass weights. Few points (fewer than 5, or fewer than 3
        distinct concurrencies) reject nothing."""
        pts = [(p, y, _weight_base(p, y, fit) ** -2) for p, y in self.points]
        n = len(pts)
        if n < 5 or self.distinct < 3 or not fit.p_star < p_min:
            return False
        free = math.fsum(w * (y - p / fit.throughput(p)) ** 2 for p, y, w in pts)
        s2 = free / (n - 3)
        bounded = min(_rss2(pts, lambda p: p, lambda p: p_min * p_min + p * p),
                      _rss2(pts, lambda p: 1.0, lambda p: p))
        return s2 > 0 and (bounded - free) / s2 > z * z

    def _variance(self, fit: UslFit, grad: list[float]) -> float | None:
        """gᵀ Cov g for the coefficients (a, b, c) of y = a + b q + c q²: Cov = s² (XᵀWX)⁻¹
        with the weights of the fit's second pass and s² the fit's own relative residual
        variance (the σ, κ >= 0 constraints are ignored). None with fewer than 4 points or 3
        distinct concurrencies, or when not finite."""
        n = len(self.points)
        if n < 4 or self.distinct < 3:
            return None
        (s0, s1, s2, s3, s4), _ = self.sums(fit)
        x = _solve3([[s0, s1, s2], [s1, s2, s3], [s2, s3, s4]], grad)
        if x is None:
            return None
        resid = math.fsum(((y - p / fit.throughput(p)) / _weight_base(p, y, fit)) ** 2
                          for p, y in self.points)
        var = resid / (n - 3) * math.fsum(g * v for g, v in zip(grad, x, strict=True))
        return var if math.isfinite(var) and var >= 0 else None

    def _fit_weighted(self, fitted: UslFit | None) -> UslFit | str:
        (s0, s1, s2, s3, s4), (t0, t1, t2) = self.sums(fitted)
        abc = _solve3([[s0, s1, s2], [s1, s2, s3], [s2, s3, s4]], [t0, t1, t2])
        if abc is None:
            return "singular least-squares system"
        fit = self._usl(*abc)
        if fit is None:
            return "fit gives λ <= 0 or a non-finite coefficient"
        if fit.kappa < 0:                      # refit with κ = 0: y linear in q
            fit = self._usl(*_solve2(s0, s1, s2, t0, t1), 0.0)
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

    def state_dict(self) -> dict:
        return {"center": self.center, "scale": self.scale,
                "points": [[p, y] for p, y in self.points]}

    def load_state_dict(self, d: dict) -> None:
        """Also reads states saved before the sums were recomputed (their extra keys: ignored)."""
        center, scale = float(d["center"]), float(d["scale"])
        if not scale > 0:
            raise ValueError("malformed scale")
        self.__init__(self.window, center, scale)
        for p, y in d["points"][-self.window:]:
            self.add(int(p), float(y))


def _weight_base(p: int, y: float, fitted: UslFit | None) -> float:
    """The y a point (p, y) is weighted by: its own in the first pass; in the second the
    fitted one, unless the point is more than SLOW_OUTLIER times slower than the fit (then it
    keeps its own, and counts little) or the fit's throughput underflows there."""
    x = fitted.throughput(p) if fitted is not None else 0.0
    if not (x > 0 and math.isfinite(p / x)):
        return y
    return y if y > SLOW_OUTLIER * (p / x) else p / x


def _rss2(pts: list[tuple[int, float, float]], f, g) -> float:
    """Weighted residual sum of squares of the least-squares fit y = u f(p) + v g(p) to the
    points (p, y, weight); inf when the system is singular."""
    col = [(f(p), g(p), y, w) for p, y, w in pts]
    u, v = _solve2(math.fsum(w * a * a for a, _, _, w in col),
                   math.fsum(w * a * b for a, b, _, w in col),
                   math.fsum(w * b * b for _, b, _, w in col),
                   math.fsum(w * a * y for a, _, y, w in col),
                   math.fsum(w * b * y for _, b, y, w in col))
    if not (math.isfinite(u) and math.isfinite(v)):
        return math.inf
    return math.fsum(w * (y - u * a - v * b) ** 2 for a, b, y, w in col)


def _solve2(m00: float, m01: float, m11: float, r0: float, r1: float) -> tuple[float, float]:
    """Solve the 2x2 normal equations [[m00, m01], [m01, m11]] x = r (nan if singular)."""
    det = m00 * m11 - m01 * m01
    if not (math.isfinite(det) and det > 0):
        return math.nan, math.nan
    return (m11 * r0 - m01 * r1) / det, (m00 * r1 - m01 * r0) / det


def _solve3(m: list[list[float]], r: list[float]) -> list[float] | None:
    """Solve a symmetric positive definite 3x3 system by Cramer's rule plus one step of
    iterative refinement (Cramer alone loses digits on wide batch-size ranges)."""
    (s0, s1, s2), (_, _, s3), (_, _, s4) = m
    adj = [[s2 * s4 - s3 * s3, s2 * s3 - s1 * s4, s1 * s3 - s2 * s2],
           [s2 * s3 - s1 * s4, s0 * s4 - s2 * s2, s1 * s2 - s0 * s3],
           [s1 * s3 - s2 * s2, s1 * s2 - s0 * s3, s0 * s2 - s1 * s1]]
    det = s0 * adj[0][0] + s1 * adj[0][1] + s2 * adj[0][2]
    if not (math.isfinite(det) and det > 0):
        return None

    def solve(rhs: list[float]) -> list[float]:
        return [sum(a * v for a, v in zip(row, rhs, strict=True)) / det for row in adj]

    x = solve(r)
    residual = [ri - sum(a * v for a, v in zip(row, x, strict=True)) for row, ri in zip(m, r,
                                                                                        strict=True)]
    return [xi + dx for xi, dx in zip(x, solve(residual), strict=True)]

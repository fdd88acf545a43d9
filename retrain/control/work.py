"""The work a step really did: a per-step cost model fitted online, so that throughput is
measured in work, not in raw sampled tokens.

Pure: no torch, no I/O. An RL step's work drifts as the policy learns: completions get
shorter and more groups are uniform (nothing to train), while per-step costs stay. Counted
in sampled tokens that looks like the machine slowing down. Here the step time is modelled as

    t = c0 + cP * prompt tokens + cC * completion tokens + cT * trained tokens + cG * groups

(all c >= 0, weighted least squares over a sliding window, weights 1/t²: relative error).
A step's work, in tokens of a fixed reference mix, is then

    equivalent tokens = p * ref_tokens * t̂(this step) / t̂(the reference mix at p)

where the reference mix (tokens and groups per sequence) is the mean of the steps seen when
the model is first fitted. Before that the equivalent tokens are the sampled tokens. The ratio
t̂(step) / t̂(reference) does not change when every cost scales by the same factor, so a
machine that gets slower or faster (the thing the controller must see) is never explained
away by the model; only a change of the work's mix is. It is a weighted mean of the
features' own ratios (the constant counting as 1), so it never goes beyond the most-changed
feature, however poorly the model is determined.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

WINDOW = 100        # steps the cost model sees
MIN_STEPS = 8       # steps before the first fit (5 coefficients, some spread)
RIDGE = 1e-3        # relative ridge on the feature coefficients (collinear features)
OTHER_P_WEIGHT = 0.05   # weight of a step at another concurrency in the fit for p


@dataclass(frozen=True)
class StepWork:
    """What one step did, counted over every sequence of the step."""

    prompt_tokens: int          # a prompt counts once per completion sampled from it
    completion_tokens: int
    trained_tokens: int = 0     # prompt + completion tokens of the completions trained on
    groups_trained: int = 0     # groups with a non-zero advantage (a uniform one trains nothing)

    @property
    def sampled_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def features(self) -> tuple[float, ...]:
        return (1.0, float(self.prompt_tokens), float(self.completion_tokens),
                float(self.trained_tokens), float(self.groups_trained))

    def usable(self) -> bool:
        return self.sampled_tokens > 0 and min(self.features()) >= 0


class WorkModel:
    """Step time as a non-negative linear function of the step's work, fitted online.

    Contention makes the cost of a token depend on the concurrency p, which a linear model
    cannot follow across batch sizes, so each fit is for one p: the window's steps at that p
    count fully, the others by OTHER_P_WEIGHT (they decide while that p has few steps)."""

    def __init__(self) -> None:
        self.steps: deque[tuple[int, tuple[float, ...], float]] = deque(maxlen=WINDOW)
        self.ref: list[float] | None = None       # reference mix per sequence (P, C, T, G)

    def add(self, p: int, work: StepWork, step_time_s: float) -> None:
        """Record one step (the reference mix is fixed once there are MIN_STEPS)."""
        self.steps.append((p, work.features(), float(step_time_s)))
        if self.ref is None and len(self.steps) >= MIN_STEPS:
            n = len(self.steps)
            self.ref = [sum(f[i] / q for q, f, _ in self.steps) / n for i in range(1, 5)]

    def costs(self, p: int) -> list[float] | None:
        """(c0, cP, cC, cT, cG) at concurrency p; None before the reference mix is fixed."""
        if self.ref is None:
            return None
        rows = [f for _, f, _ in self.steps]
        times = [t for _, _, t in self.steps]
        weights = [1.0 if q == p else OTHER_P_WEIGHT for q, _, _ in self.steps]
        return fit_costs(rows, times, weights)

    def equivalent_tokens(self, p: int, work: StepWork) -> float:
        """The step's work in tokens of the reference mix (its sampled tokens before a fit)."""
        coef = self.costs(p)
        if coef is None or self.ref is None:
            return float(work.sampled_tokens)
        predicted = _dot(coef, work.features())
        reference = _dot(coef, [1.0] + [r * p for r in self.ref])
        if not (predicted > 0 and reference > 0):
            return float(work.sampled_tokens)
        return p * (self.ref[0] + self.ref[1]) * predicted / reference

    def state_dict(self) -> dict:
        return {"steps": [[p, list(f), t] for p, f, t in self.steps], "ref": self.ref}

    @classmethod
    def from_state(cls, d: dict | None) -> WorkModel:
        model = cls()
        if not d:
            return model
        for p, f, t in d["steps"][-WINDOW:]:
            if len(f) != 5:
                raise ValueError("a work step needs 5 features")
            model.steps.append((int(p), tuple(map(float, f)), float(t)))
        model.ref = None if d["ref"] is None else [float(v) for v in d["ref"]]
        if model.ref is not None and len(model.ref) != 4:
            raise ValueError("the reference mix needs 4 values")
        return model


def fit_costs(rows: list[tuple[float, ...]], times: list[float],
              weights: list[float] | None = None) -> list[float] | None:
    """Non-negative weighted least squares of times on rows (weights w/t²), columns scaled to
    mean 1 with a small ridge; a coefficient that comes out negative is fixed at 0 and the
    rest refitted. None when nothing fits."""
    k = len(rows[0])
    scale = [sum(r[i] for r in rows) / len(rows) for i in range(k)]
    free = [i for i in range(k) if scale[i] > 0]
    while free:
        sol = _weighted_ls([[r[i] / scale[i] for i in free] for r in rows], times,
                           weights or [1.0] * len(rows))
        if sol is None:
            return None
        worst = min(range(len(free)), key=lambda j: sol[j])
        if sol[worst] >= 0:
            coef = [0.0] * k
            for j, i in enumerate(free):
                coef[i] = sol[j] / scale[i]
            return coef
        free.pop(worst)
    return None


def _weighted_ls(rows: list[list[float]], times: list[float],
                 weights: list[float]) -> list[float] | None:
    """Solve the ridge-regularised normal equations of Σ w ((r·c − t) / t)²."""
    k = len(rows[0])
    data = list(zip(rows, times, weights, strict=True))
    a = [[math.fsum(w * r[i] * r[j] / (t * t) for r, t, w in data) for j in range(k)]
         for i in range(k)]
    b = [math.fsum(w * r[i] / t for r, t, w in data) for i in range(k)]
    for i in range(k):
        a[i][i] += RIDGE * a[i][i] + 1e-12
    return _solve(a, b)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting (None if singular or not finite)."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b, strict=True)]
    for i in range(n):
        piv = max(range(i, n), key=lambda j: abs(m[j][i]))
        if not (math.isfinite(m[piv][i]) and m[piv][i] != 0.0):
            return None
        m[i], m[piv] = m[piv], m[i]
        for j in range(i + 1, n):
            f = m[j][i] / m[i][i]
            m[j] = [x - f * y for x, y in zip(m[j], m[i], strict=True)]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x if all(math.isfinite(v) for v in x) else None


def _dot(u: list[float], v: tuple[float, ...] | list[float]) -> float:
    return sum(a * b for a, b in zip(u, v, strict=True))

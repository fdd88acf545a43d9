"""The work a step really did: a per-step cost model fitted online, so that throughput is
measured in work, not in raw sampled tokens.

Pure: no torch, no I/O. An RL step's work drifts as the policy learns: completions get
shorter and more groups are uniform (nothing to train), while per-step costs stay. Counted
in sampled tokens that looks like the machine changing. Here the step time at concurrency p
is modelled as

    t = a_p + cP * prompt tokens + cC * completion tokens + cT * trained tokens + cG * groups
          + cD * decoded tokens

The constant a_p is p's own (the per-step cost, and what contention adds at that p); the
costs c >= 0 are shared by all p and come from how the step time varies with the work among
steps at the same p (weighted least squares on the deviations from each p's mean, weights
1/t̄_p²: relative error), over a sliding window of WINDOW steps. Shared costs learn from the
whole window, so the mix of a long-gone phase of the run still anchors them.

A step's work, in tokens of a fixed reference mix, is then

    equivalent tokens = p * ref_tokens * t̂(this step) / t̂(the reference mix at p)

where the reference mix (tokens and groups per sequence) is the mean of the first MIN_STEPS
steps. Before that the equivalent tokens are the sampled tokens. The ratio t̂(step) /
t̂(reference) does not change when every cost scales by the same factor, so a machine that
gets slower or faster (the thing the controller must see) is not explained away by the model;
only a change of the work's mix is. It is a weighted mean of the features' own ratios (the
constant counting as 1), so it never goes beyond the most-changed feature, however poorly the
model is determined.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

WINDOW = 200        # steps the cost model sees
MIN_STEPS = 8       # steps before the reference mix is fixed and the model is used
RIDGE = 1e-3        # relative ridge on the costs (collinear features)

Step = tuple[int, tuple[float, ...], float]      # (p, the features, step time)
FEATURES = 5


@dataclass(frozen=True)
class StepWork:
    """What one step did, counted over every sequence of the step."""

    prompt_tokens: int          # a prompt counts once per completion sampled from it
    completion_tokens: int
    trained_tokens: int = 0     # prompt + completion tokens of the completions trained on
    groups_trained: int = 0     # groups with a non-zero advantage (a uniform one trains nothing)
    # Completion tokens as a batched decode runs them: every sequence as long as the longest
    # (sequences x the longest completion), so a few completions running to max_tokens cost
    # like all of them doing so. On the CPU quickstart sampling went 5 s -> 3.7 s at batch 11
    # as those vanished while the mean completion stayed 17 tokens: counted without this,
    # that looked like the machine getting faster (a drift alarm, bench/RESULTS.md).
    decoded_tokens: int = 0

    @property
    def sampled_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def features(self) -> tuple[float, ...]:
        return (float(self.prompt_tokens), float(self.completion_tokens),
                float(self.trained_tokens), float(self.groups_trained),
                float(self.decoded_tokens))

    def usable(self) -> bool:
        return self.sampled_tokens > 0 and min(self.features()) >= 0


class WorkModel:
    """Step time as a per-p constant plus shared non-negative costs of the work."""

    def __init__(self) -> None:
        self.steps: deque[Step] = deque(maxlen=WINDOW)
        self.ref: list[float] | None = None       # reference mix per sequence (P, C, T, G, D)

    def add(self, p: int, work: StepWork, step_time_s: float) -> None:
        """Record one step (the reference mix is fixed once there are MIN_STEPS)."""
        self.steps.append((p, work.features(), float(step_time_s)))
        if self.ref is None and len(self.steps) >= MIN_STEPS:
            n = len(self.steps)
            self.ref = [sum(f[i] / q for q, f, _ in self.steps) / n for i in range(FEATURES)]

    def equivalent_tokens(self, p: int, work: StepWork) -> float:
        """The step's work in tokens of the reference mix (its sampled tokens before a fit
        or without steps at p)."""
        at_p = [(f, t) for q, f, t in self.steps if q == p]
        costs = fit_costs(list(self.steps)) if self.ref is not None and at_p else None
        if costs is None or self.ref is None:
            return float(work.sampled_tokens)
        mean_f = [sum(f[i] for f, _ in at_p) / len(at_p) for i in range(FEATURES)]
        a_p = max(0.0, sum(t for _, t in at_p) / len(at_p) - _dot(costs, mean_f))
        predicted = a_p + _dot(costs, work.features())
        reference = a_p + _dot(costs, [r * p for r in self.ref])
        if not (predicted > 0 and reference > 0):
            return float(work.sampled_tokens)
        return p * (self.ref[0] + self.ref[1]) * predicted / reference

    def state_dict(self) -> dict:
        return {"steps": [[p, list(f), t] for p, f, t in self.steps], "ref": self.ref}

    @classmethod
    def from_state(cls, d: dict | None) -> WorkModel:
        """The saved model; one saved before decoded tokens were counted (4 features)
        starts afresh (its steps did not record it), like a run without one."""
        model = cls()
        if not d or (d["ref"] is not None and len(d["ref"]) == FEATURES - 1) \
                or any(len(f) == FEATURES - 1 for _, f, _ in d["steps"]):
            return model
        for p, f, t in d["steps"][-WINDOW:]:
            if len(f) != FEATURES:
                raise ValueError(f"a work step needs {FEATURES} features")
            model.steps.append((int(p), tuple(map(float, f)), float(t)))
        model.ref = None if d["ref"] is None else [float(v) for v in d["ref"]]
        if model.ref is not None and len(model.ref) != FEATURES:
            raise ValueError(f"the reference mix needs {FEATURES} values")
        return model


def fit_costs(steps: list[Step]) -> list[float] | None:
    """The shared costs (cP, cC, cT, cG, cD) >= 0: least squares of each step's deviation from
    its p's mean time on its deviation from its p's mean work, weighted 1/t̄_p²; a cost that
    comes out negative is fixed at 0 and the rest refitted. None when nothing varies."""
    rows, ys, ws = _deviations(steps)
    if not rows:
        return None
    a, b = _normal_equations(rows, ys, ws)
    scale = [math.sqrt(a[i][i]) for i in range(FEATURES)]   # each column to unit weighted norm
    free = [i for i in range(FEATURES) if scale[i] > 0]
    while free:
        sol = _solve([[a[i][j] / (scale[i] * scale[j]) * (1 + RIDGE * (i == j)) for j in free]
                      for i in free], [b[i] / scale[i] for i in free])
        if sol is None:
            return None
        worst = min(range(len(free)), key=lambda j: sol[j])
        if sol[worst] >= 0:
            costs = [0.0] * FEATURES
            for j, i in enumerate(free):
                costs[i] = sol[j] / scale[i]
            return costs
        free.pop(worst)        # the normal equations of the other columns: a sub-matrix
    return [0.0] * FEATURES


def _deviations(steps: list[Step]) -> tuple[list[list[float]], list[float], list[float]]:
    """Each step's (work - its p's mean work, time - its p's mean time, 1 / mean time²)."""
    by_p: dict[int, list[tuple[tuple[float, ...], float]]] = {}
    for p, f, t in steps:
        by_p.setdefault(p, []).append((f, t))
    rows, ys, ws = [], [], []
    for pts in by_p.values():
        if len(pts) < 2:
            continue
        mean_t = sum(t for _, t in pts) / len(pts)
        mean_f = [sum(f[i] for f, _ in pts) / len(pts) for i in range(FEATURES)]
        for f, t in pts:
            rows.append([f[i] - mean_f[i] for i in range(FEATURES)])
            ys.append(t - mean_t)
            ws.append(1.0 / (mean_t * mean_t))
    return rows, ys, ws


def _normal_equations(rows: list[list[float]], ys: list[float],
                      ws: list[float]) -> tuple[list[list[float]], list[float]]:
    """(Σ w r rᵀ, Σ w r y): the normal equations of Σ w (r·c − y)²."""
    data = list(zip(rows, ys, ws, strict=True))
    a = [[0.0] * FEATURES for _ in range(FEATURES)]
    for i in range(FEATURES):
        for j in range(i, FEATURES):      # symmetric
            a[i][j] = a[j][i] = math.fsum(w * r[i] * r[j] for r, _, w in data)
    return a, [math.fsum(w * r[i] * y for r, y, w in data) for i in range(FEATURES)]


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

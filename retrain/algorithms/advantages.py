"""Group advantages: one reward per completion in, one advantage per completion out.

Pure (no torch, no I/O). `rewards[g][i]` is the reward of completion i of prompt g; every
method is group-relative, so a group whose rewards are all equal (a size-1 group included)
carries no signal and gets zero advantages. `uniform_group_rate` is the fraction of such groups.

Methods (m = group mean, s = population std, EPS = 1e-6):
- grpo:          (r - m) / (s + EPS), s of the group (std_scale="group"), of every reward in
                 the batch ("batch"), or no division ("none"). Shao et al. 2024, DeepSeekMath.
- dr_grpo:       r - m (no std division; Liu et al. 2025, "Understanding R1-Zero-Like Training").
- rloo:          r_i - mean_{j != i} r_j = (r_i - m) * G / (G - 1)  (Ahmadian et al. 2024).
- maxrl:         (r - m) / m, the Maximum Likelihood RL estimator (Tajwar et al. 2026,
                 arXiv:2602.02710): for 0/1 rewards it averages the score function over the
                 K successful samples (weight N/K - 1 for a success, -1 for a failure), an
                 unbiased estimate of grad log p(success) with the group mean as control
                 variate. Meant for rewards in [0, 1]; a group with m <= 0 gets zeros.
- reinforce_pp:  REINFORCE++ with group baseline (Hu 2025): c = r - m per group, then
                 (c - mean(c)) / (std(c) + EPS) over every completion in the batch.

Every output is finite for finite input: rewards beyond 1e150 in magnitude are rescaled by
a power of two before squaring, and a result too large for a float saturates at +-max float.
`mean_and_std` is the same guard for the reward statistics the trainer logs.

`bounded_for_loss` is applied by the trainer before the (float32) loss: advantages beyond
LOSS_LIMIT in magnitude (dr_grpo, rloo and grpo with std_scale = "none" keep reward units, so
+-1e20 rewards give +-1e20 advantages) are all divided by one power of two, which keeps their
order and ratios, so the gradient stays finite and keeps its direction.
"""

from __future__ import annotations

import math
import sys

METHODS = ("grpo", "dr_grpo", "rloo", "maxrl", "reinforce_pp")
STD_SCALES = ("group", "batch", "none")
EPS = 1e-6
_BIG = 1e150  # beyond this, squares could overflow: rescale first
_MAX = sys.float_info.max
LOSS_LIMIT = 2.0 ** 16  # largest |advantage| the loss is given (see bounded_for_loss)


def is_uniform(group: list[float]) -> bool:
    """All rewards equal (up to float noise); empty and single-completion groups count too."""
    if len(group) < 2:
        return True
    lo, hi = min(group), max(group)
    return hi - lo <= 1e-12 * max(1.0, abs(lo), abs(hi))


def uniform_group_rate(rewards: list[list[float]]) -> float:
    """Fraction of groups whose rewards are all equal (they contribute no gradient)."""
    if not rewards:
        return 0.0
    return sum(is_uniform([float(r) for r in g]) for g in rewards) / len(rewards)


def compute_advantages(rewards: list[list[float]], method: str,
                       std_scale: str = "group") -> list[list[float]]:
    """Per-completion advantages, shaped like `rewards` (see the module docstring)."""
    if method not in METHODS:
        raise ValueError(f"unknown advantage method {method!r}; use one of {', '.join(METHODS)}")
    if std_scale not in STD_SCALES:
        raise ValueError(f"unknown std_scale {std_scale!r}; use one of {', '.join(STD_SCALES)}")
    groups = [[float(r) for r in g] for g in rewards]
    if not all(math.isfinite(r) for g in groups for r in g):
        raise ValueError("rewards must be finite numbers")
    scale = _scale_for(max((abs(r) for g in groups for r in g), default=0.0))
    if scale != 1.0:
        groups = [[r / scale for r in g] for g in groups]
    out = _ADVANTAGES[method](groups, std_scale)
    if method in ("dr_grpo", "rloo") or (method == "grpo" and std_scale == "none"):
        out = [[_saturate(a * scale) for a in g] for g in out]  # these keep reward units
    return [[0.0 if is_uniform(g) else _saturate(a) for a in adv]
            for g, adv in zip(groups, out, strict=True)]


def bounded_for_loss(advantages: list[list[float]]) -> tuple[list[list[float]], float]:
    """(advantages, divisor): when the largest |advantage| exceeds LOSS_LIMIT, every one is
    divided by the same power of two (exact, order and ratios kept) and clamped into
    [-LOSS_LIMIT, LOSS_LIMIT]; the divisor is 1.0 when nothing changed."""
    peak = max((abs(float(a)) for g in advantages for a in g), default=0.0)
    if not math.isfinite(peak):
        raise ValueError("advantages must be finite numbers")
    if peak <= LOSS_LIMIT:
        return [[float(a) for a in g] for g in advantages], 1.0
    divisor = 2.0 ** math.ceil(math.log2(peak / LOSS_LIMIT))
    return [[max(-LOSS_LIMIT, min(LOSS_LIMIT, a / divisor)) for a in g]
            for g in advantages], divisor


def mean_and_std(values: list[float]) -> tuple[float, float]:
    """Population mean and std, finite for any finite input (1e200 rewards included)."""
    xs = [float(v) for v in values]
    if not all(math.isfinite(x) for x in xs):
        raise ValueError("values must be finite numbers")
    scale = _scale_for(max((abs(x) for x in xs), default=0.0))
    scaled = [x / scale for x in xs]
    return _saturate(_mean(scaled) * scale), _saturate(_std(scaled) * scale)


def _scale_for(peak: float) -> float:
    """1, or a power of two that brings `peak` into (1, 2] (exact, and squares cannot
    overflow) when it is beyond 1e150."""
    return 2.0 ** (math.ceil(math.log2(peak)) - 1) if peak > _BIG else 1.0


def _mean(xs: list[float]) -> float:
    return math.fsum(xs) / len(xs) if xs else 0.0


def _std(xs: list[float]) -> float:
    m = _mean(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / len(xs)) if xs else 0.0


def _centered(g: list[float]) -> list[float]:
    m = _mean(g)
    return [r - m for r in g]


def _saturate(x: float) -> float:
    return max(-_MAX, min(_MAX, x))


def _grpo(groups: list[list[float]], std_scale: str) -> list[list[float]]:
    if std_scale == "none":
        return [_centered(g) for g in groups]
    batch_std = _std([r for g in groups for r in g])
    return [[c / ((_std(g) if std_scale == "group" else batch_std) + EPS) for c in _centered(g)]
            for g in groups]


def _dr_grpo(groups: list[list[float]], std_scale: str) -> list[list[float]]:
    return [_centered(g) for g in groups]


def _rloo(groups: list[list[float]], std_scale: str) -> list[list[float]]:
    return [[c * len(g) / (len(g) - 1) for c in _centered(g)] if len(g) > 1 else [0.0] * len(g)
            for g in groups]


def _maxrl(groups: list[list[float]], std_scale: str) -> list[list[float]]:
    out = []
    for g in groups:
        m = _mean(g)
        out.append([c / m for c in _centered(g)] if m > 0 else [0.0] * len(g))
    return out


def _reinforce_pp(groups: list[list[float]], std_scale: str) -> list[list[float]]:
    centered = [[0.0] * len(g) if is_uniform(g) else _centered(g) for g in groups]
    flat = [c for g in centered for c in g]
    mu, sd = _mean(flat), _std(flat)
    return [[(c - mu) / (sd + EPS) for c in g] for g in centered]


_ADVANTAGES = {"grpo": _grpo, "dr_grpo": _dr_grpo, "rloo": _rloo, "maxrl": _maxrl,
               "reinforce_pp": _reinforce_pp}

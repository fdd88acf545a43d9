"""The back-pressure controller's regime table: from the fit and the step just observed, the
regime, the next batch size (before the bounds) and the rule that chose it; and the words
that explain each rule.

Pure: no torch, no I/O. The controller (`backpressure`) applies the bounds and the
out-of-memory ceiling to what the table asks for.
"""

from __future__ import annotations

from typing import NamedTuple

from retrain.control.roofline import Roofline, regime_from_fit
from retrain.control.usl import UslFit


class Goal(NamedTuple):
    """Where the fit says to go: the target batch size, its concurrency, and which bound set
    it ("throughput" or "goodput")."""

    target: int
    p: float
    bound: str


class Margins(NamedTuple):
    throttle: float         # target fraction of p* (backpressure.throttle_margin)
    increase: float         # hysteresis: below increase * the goal's p, go to the target


def classify(fit: UslFit, b: int, p: int, ratio: float, roof: Roofline | None, goal: Goal,
             margins: Margins, rule: str, approaching: bool) -> tuple[str, int, str]:
    """(regime, next batch size, rule) for a step at batch size `b` (concurrency `p`) whose
    smoothed throughput is `ratio` of the fit's. `rule` "first" or "landing" comes in set and
    always goes to the target; `approaching`: the last increase was cut short below an
    out-of-memory ceiling."""
    if fit.kappa > 0 and p > margins.throttle * fit.p_star:
        return "retrograde", goal.target, "retrograde"
    regime = roof.regime if roof is not None else regime_from_fit(ratio)
    if rule:
        return regime, goal.target, rule
    if regime == "warmup":
        return regime, b, "overestimates"
    if goal.bound == "goodput" and b > goal.target:
        return regime, goal.target, "goodput"
    if p < margins.increase * goal.p:
        return regime, goal.target, "below"
    if approaching and goal.target > b:
        return regime, goal.target, "approaching"
    return regime, b, ""


def rule_reason(rule: str, p: int, p_star: float, ratio: float, bound: str,
                margins: Margins) -> str:
    """Why `rule` moved (or held) the batch size, with where the step sits on the fit."""
    tm, im = margins
    where = f"p={p}, p*={p_star:.4g}, throughput {ratio:.0%} of the fit"
    target = f"{tm} * p*" if bound == "throughput" else "the goodput bound"
    return {"retrograde": f"p > {tm} * p* ({where})",
            "first": f"moving to {target} after exploring ({where})",
            "landing": f"last refit after exploring: landing on {target} ({where})",
            "overestimates": f"fit overestimates this point ({where}): holding",
            "goodput": f"above the goodput bound: larger batches stop helping ({where})",
            "below": f"below target: p < {im} * {target} ({where})",
            "approaching": f"approaching {target} below the out-of-memory ceiling ({where})",
            }.get(rule, where)


def roofline_note(roof: Roofline) -> str:
    """The step's place on the roofline, appended to the reason."""
    return (f"; roofline: {roof.intensity:.3g} FLOP/B vs balance {roof.balance:.3g}, "
            f"{roof.compute_fraction:.0%} of peak FLOP/s, "
            f"{roof.memory_fraction:.0%} of peak bandwidth")

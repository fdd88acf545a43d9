"""What the back-pressure controller concludes from one step (`Decision`) and the bp_* keys
it writes to metrics.jsonl.

Pure: no torch, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

METRIC_KEYS = ("bp_action", "bp_regime", "bp_p_star", "bp_sigma", "bp_kappa", "bp_lambda",
               "bp_utilization", "bp_throughput", "bp_p", "bp_goodput", "bp_efficiency",
               "bp_step_throughput")


@dataclass(frozen=True)
class Decision:
    """What the controller concluded from one step; `batch_size` is for the next step."""

    action: str                        # hold | throttle | increase
    regime: str                        # warmup | retrograde | memory_bound | compute_bound | ...
    batch_size: int
    p: int = 0                         # concurrency of the observed step
    p_star: float | None = None        # None = no fit yet; inf = no finite optimum (κ = 0)
    sigma: float | None = None
    kappa: float | None = None
    lam: float | None = None           # tokens/s at p = 1
    utilization: float | None = None   # smoothed throughput / fitted peak within the bounds
    throughput: float | None = None    # EMA-smoothed tokens/s at the current p
    reason: str = ""
    goodput: float | None = None       # throughput x efficiency (needs the noise scale)
    efficiency: float | None = None    # statistical efficiency of the observed batch size
    step_throughput: float | None = None   # this step's throughput as the controller read it

    def metrics(self) -> dict:
        """The bp_* keys for metrics.jsonl (finite numbers or None; {} when disabled)."""
        if self.regime == "disabled":
            return {}
        return {"bp_action": self.action, "bp_regime": self.regime,
                "bp_p_star": _finite(self.p_star), "bp_sigma": _finite(self.sigma),
                "bp_kappa": _finite(self.kappa), "bp_lambda": _finite(self.lam),
                "bp_utilization": _finite(self.utilization),
                "bp_throughput": _finite(self.throughput), "bp_p": self.p,
                "bp_goodput": _finite(self.goodput), "bp_efficiency": _finite(self.efficiency),
                "bp_step_throughput": _finite(self.step_throughput)}


def action_of(b: int, nxt: int) -> str:
    """The move from batch size `b` to `nxt`, in words."""
    return "throttle" if nxt < b else "increase" if nxt > b else "hold"


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None

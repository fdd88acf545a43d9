"""KL to the reference (base) model, estimated on the sampled tokens (pure).

Schulman's estimators of KL(policy || reference) from one sample y ~ policy, with
log_ratio = log q_ref(y) - log p(y):
- k1 = -log_ratio: unbiased, can be negative for a single token;
- k3 = exp(log_ratio) - 1 - log_ratio: unbiased, never negative, lower variance (verl's
  `low_var_kl`).

Both work on floats and on tensors (the local backend adds them to its per-token loss); this
module imports no torch.
"""

from __future__ import annotations

import math
from typing import Any

ESTIMATORS = ("k1", "k3")


def token_kl(logp: Any, ref_logp: Any, estimator: str) -> Any:
    """The estimate at each token (float or tensor, as given)."""
    log_ratio = ref_logp - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        return _expm1(log_ratio) - log_ratio  # expm1: no cancellation near 0
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {ESTIMATORS}")


def sequence_kl(logps: list[float], ref_logps: list[float], mask: list[float],
                estimator: str) -> tuple[float, int]:
    """(sum of the estimate over the masked tokens, how many there are)."""
    total, count = 0.0, 0
    for lp, ref, m in zip(logps, ref_logps, mask, strict=True):
        if m:
            total += token_kl(lp, ref, estimator)
            count += 1
    return total, count


def _expm1(x: Any) -> Any:
    # log_ratio beyond 700 overflows a float; a tensor saturates to inf by itself
    return x.expm1() if hasattr(x, "expm1") else math.expm1(min(x, 700.0))

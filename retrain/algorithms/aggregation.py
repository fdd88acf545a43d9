"""How one forward_backward call's per-token losses become one number: the normaliser, decided
here for every loss and both backends. Pure.

    token_mean     the sum over the call's loss tokens / their count (DAPO; the default)
    sequence_mean  the mean over sequences of each sequence's token mean
    constant       the sum / (max_tokens x sequences) (Dr. GRPO: a fixed normaliser)
    sum            no normaliser: Tinker's own losses are sums (what `retrain serve` computes)

"Sequences" are the call's datums that carry loss tokens. A `Normaliser` gives datum i the
weight weights[i] / denominator on each of its token losses; token_mean keeps weight 1 and
divides once, so its loss is the same float sum divided by the count as it always was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

AGGREGATIONS = ("token_mean", "sequence_mean", "constant")
SUM = "sum"


@dataclass(frozen=True)
class Normaliser:
    """The call's loss is sum_i weights[i] * (datum i's summed token losses) / denominator."""

    weights: tuple[float, ...]
    denominator: float

    def scale(self, i: int) -> float:
        """The factor on each token loss of datum i."""
        return self.weights[i] / self.denominator


def normaliser(tokens: Sequence[int], how: str, max_tokens: int = 0) -> Normaliser:
    """The normaliser of a call whose datum i carries `tokens[i]` loss tokens; `max_tokens` is
    the per-sequence token budget `constant` divides by."""
    sequences = sum(1 for n in tokens if n > 0)
    ones = tuple(1.0 for _ in tokens)
    if how == "token_mean":
        return Normaliser(ones, float(sum(tokens)) or 1.0)
    if how == "sequence_mean":
        return Normaliser(tuple(1.0 / n if n > 0 else 0.0 for n in tokens),
                          float(sequences) or 1.0)
    if how == "constant":
        if max_tokens < 1:
            raise ValueError("constant aggregation needs max_tokens >= 1")
        return Normaliser(ones, float(max_tokens * sequences) or 1.0)
    if how == SUM:
        return Normaliser(ones, 1.0)
    raise ValueError(f"unknown loss_aggregation {how!r}; use one of {', '.join(AGGREGATIONS)}")

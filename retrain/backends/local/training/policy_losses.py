"""The policy losses as tensor math, one definition each, shared by the local backend and
`retrain serve` (algorithms/losses.py gives the formulas; algorithms/aggregation.py the
normaliser the caller applies to the per-token losses returned here).

Tensors are aligned over a batch's loss tokens: the trainer's log-probs `new` (with their
gradient), the sampler's `old`, the advantages (for cross_entropy: the token weights), and for
gspo `seq` (which sequence each token belongs to, 0..n-1) and `in_ratio` (whether its log-ratio
counts in that sequence's ratio), with `sequences`, their count, where the caller knows it
(else read from `seq`, a host read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retrain.algorithms.losses import CLIPPED, unknown_loss
from retrain.backends.base import LossConfig


@dataclass
class TokenTerms:
    """Per-token losses, and the ratio they used (detached; None for cross_entropy) with
    whether it fell outside the clip range."""

    loss: torch.Tensor
    ratio: torch.Tensor | None = None
    clipped: torch.Tensor | None = None
    truncated: torch.Tensor | None = None   # the ratio was above loss.ratio_cap


def token_losses(new: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, loss: LossConfig,
                 seq: torch.Tensor | None = None, in_ratio: torch.Tensor | None = None,
                 sequences: int | None = None) -> TokenTerms:
    """Each token's loss under `loss` (Tinker's definitions; a datum's loss is their sum)."""
    name = loss.name
    if name == "cross_entropy":
        return TokenTerms(-adv * new)
    ratio = (sequence_ratio(new, old, seq, in_ratio, sequences) if name == "gspo"
             else torch.exp(new - old))
    raw, truncated = ratio.detach(), None
    if loss.ratio_cap and name != "dro":
        ratio, truncated = truncate(ratio, loss.ratio_cap)
    lo, hi = loss.thresholds
    if name == "importance_sampling":
        out = -ratio * adv
    elif name in ("ppo", "gspo"):
        out = -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
        if name == "ppo" and loss.clip_ratio_c:
            # dual clip: a negative-advantage token loses at most c |A|
            out = torch.where(adv < 0, torch.minimum(out, -loss.clip_ratio_c * adv), out)
    elif name == "cispo":
        out = -ratio.clamp(lo, hi).detach() * new * adv
    elif name == "dro":
        out = -(new * adv - 0.5 * loss.dro_beta * (new - old) ** 2)
    else:
        raise ValueError(unknown_loss(name))
    r = ratio.detach()
    clipped = (r < lo) | (r > hi) if name in CLIPPED else torch.zeros_like(r, dtype=torch.bool)
    return TokenTerms(out, raw, clipped, truncated)


def truncate(ratio: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling: a token's ratio counts at most `cap` (its gradient
    scaled to match, direction kept), so a token the sampler drew far more often than the
    trainer would does not dominate the update. Returns (the ratio, which tokens were cut)."""
    r = ratio.detach()
    cut = r > cap
    return torch.where(cut, ratio * (cap / r), ratio), cut


def sequence_ratio(new: torch.Tensor, old: torch.Tensor, seq: torch.Tensor | None,
                   in_ratio: torch.Tensor | None, sequences: int | None = None) -> torch.Tensor:
    """GSPO-token: each token's ratio has its sequence's value, exp(mean of new - old over the
    sequence's `in_ratio` tokens), and its own log-prob's gradient. A sequence with no such
    token has ratio 1. `sequences`: how many (else seq's largest + 1)."""
    seq = torch.zeros_like(new, dtype=torch.long) if seq is None else seq
    in_ratio = torch.ones_like(new, dtype=torch.bool) if in_ratio is None else in_ratio
    n = sequences if sequences is not None else int(seq.max()) + 1 if seq.numel() else 0
    delta = torch.where(in_ratio, new.detach() - old, torch.zeros_like(new))
    sums = torch.zeros(n, dtype=new.dtype, device=new.device).index_add_(0, seq, delta)
    counts = torch.zeros(n, dtype=new.dtype, device=new.device).index_add_(
        0, seq, in_ratio.to(new.dtype))
    log_s = sums / counts.clamp(min=1)
    return torch.exp(log_s[seq] + new - new.detach())


class RatioStats:
    """The ratio metrics of one forward_backward call, over its loss tokens: `clip_fraction`
    (ratio outside the clip range), `ratio_mean`, `ratio_max` (before any truncation), and
    with a ratio cap `ratio_truncated` (the share of tokens it cut). The sums stay on the
    device until `metrics` reads them, once."""

    def __init__(self) -> None:
        self.tokens = 0
        self.sums: torch.Tensor | None = None   # clipped, truncated, ratio total, ratio max
        self.capped = False

    def add(self, terms: TokenTerms) -> None:
        if terms.ratio is None or terms.ratio.numel() == 0:
            return
        self.tokens += terms.ratio.numel()
        r = terms.ratio.float()
        cut = terms.truncated
        self.capped = self.capped or cut is not None
        now = torch.stack([terms.clipped.sum().float(),
                           cut.sum().float() if cut is not None else r.new_zeros(()),
                           r.sum(), r.max()])
        if self.sums is None:
            self.sums = now
        else:
            self.sums = torch.cat([self.sums[:3] + now[:3], torch.maximum(self.sums[3:],
                                                                          now[3:])])

    def metrics(self) -> dict[str, float]:
        if not self.tokens or self.sums is None:
            return {}
        clipped, truncated, total, top = self.sums.tolist()
        out = {"clip_fraction": clipped / self.tokens,
               "ratio_mean": total / self.tokens, "ratio_max": top}
        if self.capped:
            out["ratio_truncated"] = truncated / self.tokens
        return out

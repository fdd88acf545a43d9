"""Policy losses and micro-batch packing for the local backend.

Token aggregation: every completion token of the whole `forward_backward` call weighs the
same. Each micro-batch adds `sum(per-token loss) / total completion tokens of the call` to
the gradient, so splitting into micro-batches never changes the result (up to float
rounding) and long completions weigh more than short ones, as in DAPO / Dr. GRPO.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retrain.backends.base import Datum, LossConfig

LOSSES = ("importance_sampling", "ppo")


def per_token_loss(new_lp: torch.Tensor, old_lp: torch.Tensor, adv: torch.Tensor,
                   loss: LossConfig) -> torch.Tensor:
    """Loss of each target token; ratio = exp(new - old) with the sampler's log-probs as old."""
    ratio = torch.exp(new_lp - old_lp)
    if loss.name == "importance_sampling":
        return -ratio * adv
    if loss.name == "ppo":
        clipped = ratio.clamp(1.0 - loss.clip_eps, 1.0 + loss.clip_eps_high)
        return -torch.minimum(ratio * adv, clipped * adv)
    raise ValueError(f"unknown loss {loss.name!r}; expected one of {LOSSES}")


@dataclass
class Packed:
    """A right-padded micro-batch. `keep` marks the target positions that carry loss."""

    index: list[int]            # datum indices, in row order
    input_ids: torch.Tensor     # (b, L)
    targets: torch.Tensor       # (n_keep,)  targets at the kept positions, row-major
    old_logprobs: torch.Tensor  # (n_keep,)
    advantages: torch.Tensor    # (n_keep,)
    keep: torch.Tensor          # (b, L) bool


def pack(datums: list[Datum], index: list[int], pad_id: int, device: torch.device) -> Packed:
    """Right-pad the datums at `index` (right padding needs no attention mask under causality)."""
    width = max(len(datums[i]) for i in index)
    ids = torch.full((len(index), width), pad_id, dtype=torch.long)
    keep = torch.zeros((len(index), width), dtype=torch.bool)
    targets, old, adv = [], [], []
    for row, i in enumerate(index):
        d = datums[i]
        ids[row, :len(d)] = torch.tensor(d.input_tokens, dtype=torch.long)
        for pos, m in enumerate(d.mask):
            if m > 0:
                keep[row, pos] = True
                targets.append(d.target_tokens[pos])
                old.append(d.logprobs[pos])
                adv.append(d.advantages[pos])
    return Packed(index=index, input_ids=ids.to(device),
                  targets=torch.tensor(targets, dtype=torch.long, device=device),
                  old_logprobs=torch.tensor(old, dtype=torch.float32, device=device),
                  advantages=torch.tensor(adv, dtype=torch.float32, device=device),
                  keep=keep.to(device))


def micro_batches(datums: list[Datum], size: int, vocab_size: int) -> list[list[int]]:
    """Datum indices grouped into micro-batches of similar length (less padding).

    `size` 0 = automatic: at most 8192 padded tokens and 2**26 logit entries per chunk.
    """
    order = sorted(range(len(datums)), key=lambda i: len(datums[i]))
    chunks: list[list[int]] = []
    current: list[int] = []
    for i in order:
        candidate = current + [i]
        if current and not _fits(datums, candidate, size, vocab_size):
            chunks.append(current)
            candidate = [i]
        current = candidate
    if current:
        chunks.append(current)
    return chunks


def _fits(datums: list[Datum], index: list[int], size: int, vocab_size: int) -> bool:
    if size > 0:
        return len(index) <= size
    width = max(len(datums[i]) for i in index)
    targets = sum(sum(1 for m in datums[i].mask if m > 0) for i in index)
    return width * len(index) <= 8192 and targets * vocab_size <= 2**26

"""Micro-batch planning and packing for the local backend's training pass.

Aggregation: the call's normaliser (algorithms/aggregation.py, `loss.aggregation`) is decided
once over the whole `forward_backward` call; each micro-batch adds its share, the sum of its
weighted per-token losses (training/policy_losses.py) / the call's denominator, so
splitting into micro-batches never changes the result (up to float rounding).

Shared prompts: the completions of one group share their prompt, so a micro-batch runs
each distinct prompt *prefix* once (left-padded together, with gradients), repeats its KV
cache for its completions, and runs the per-completion *suffixes* on top: two forward calls
per micro-batch, the same layout as the sampler. The gradient is exactly that of running
every full sequence (causal attention: the prompt never sees its completion).

Length buckets: completions of one micro-batch differ in length (EOS), and padding every
suffix to the longest wasted 37-63% of the suffix tokens in a 4x8 SmolLM2 step. The suffixes
therefore run in a few buckets of similar length (`length_buckets`), each on its own copy of
the prefix cache, so padding costs a few tokens per bucket instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from retrain.backends.base import Datum

AUTO_TOKENS = 8192        # automatic micro-batches: padded suffix tokens per chunk
AUTO_LOGITS = 2**26       # ... and logit entries (loss-carrying targets x vocab) per chunk
BUCKET_OVERHEAD = 16      # padded token-rows that one more suffix forward (its fixed cost) is worth


def split_point(d: Datum) -> int:
    """Input position of the first target that carries loss: the prompt's last token."""
    for pos, m in enumerate(d.mask):
        if m > 0:
            return pos
    return len(d.mask)


@dataclass
class Unit:
    """One micro-batch: datum indices, ordered by (prefix, length)."""

    index: list[int]


def plan(datums: list[Datum], size: int, vocab_size: int) -> list[Unit]:
    """Micro-batches of at most `size` datums (0 = automatic budget), prompt-mates together.

    Datums without loss-carrying targets are left out (they add nothing to the gradient).
    Datums whose prefix is empty (one-token prompts) get micro-batches of their own.
    """
    keyed = []
    for i, d in enumerate(datums):
        s = split_point(d)
        if s < len(d.mask):
            keyed.append((s == 0, tuple(d.input_tokens[:s]), len(d), i, len(d) - s,
                          sum(1 for m in d.mask[s:] if m > 0)))
    keyed.sort()
    units: list[Unit] = []
    current: list[int] = []
    width = kept = 0  # the current unit's longest suffix and its loss-carrying targets
    for empty, _, _, i, suffix, targets in keyed:
        if current and (empty != (split_point(datums[current[0]]) == 0) or not _fits(
                len(current) + 1, max(width, suffix), kept + targets, size, vocab_size)):
            units.append(Unit(current))
            current, width, kept = [], 0, 0
        current.append(i)
        width, kept = max(width, suffix), kept + targets
    if current:
        units.append(Unit(current))
    return units


def _fits(rows: int, width: int, kept: int, size: int, vocab_size: int) -> bool:
    """Whether a unit fits: `size` rows, or the automatic budget of what a micro-batch
    materialises: the suffixes padded to `width` (an upper bound of the length buckets) and
    logits for the `kept` loss-carrying targets only (`logits_to_keep`), not padded rows."""
    if size > 0:
        return rows <= size
    return width * rows <= AUTO_TOKENS and kept * vocab_size <= AUTO_LOGITS


def length_buckets(lengths: list[int], overhead: int = BUCKET_OVERHEAD) -> list[list[int]]:
    """Row indices in runs of similar length, shortest first: the cut of the rows sorted by
    length that minimises (rows x longest) summed over runs + `overhead` per run."""
    order = sorted(range(len(lengths)), key=lambda r: lengths[r])
    best = [0] + [None] * len(order)   # best[j]: cost of the first j rows of `order`
    cut = [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        longest = lengths[order[j - 1]]
        for i in range(j):
            cost = best[i] + (j - i) * longest + overhead
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    runs, j = [], len(order)
    while j > 0:
        runs.append(order[cut[j]:j])
        j = cut[j]
    return runs[::-1]


@dataclass
class Packed:
    """A micro-batch as tensors: distinct prefixes (left-padded) + suffixes (right-padded)."""

    prefix_ids: torch.Tensor | None   # (P, Lp) distinct prompt prefixes, or None if empty
    prefix_mask: torch.Tensor | None  # (P, Lp)
    row_prefix: torch.Tensor          # (b,) which prefix each suffix row continues
    input_ids: torch.Tensor           # (b, W) suffix tokens
    suffix_mask: torch.Tensor         # (b, W)
    positions: torch.Tensor           # (b, W) position ids of the suffix tokens
    keep: torch.Tensor                # (b, W) bool: targets that carry loss
    targets: torch.Tensor             # (n_keep,) row-major over `keep`
    old_logprobs: torch.Tensor        # (n_keep,)
    advantages: torch.Tensor          # (n_keep,)
    where: list[tuple[int, int]]      # (datum index, target position) of each kept entry
    weights: torch.Tensor             # (n_keep,) the aggregation weight of each entry's datum
    seq: torch.Tensor                 # (n_keep,) the row (sequence) of each entry
    in_ratio: torch.Tensor            # (n_keep,) bool: counts in its sequence's gspo ratio


def pack(datums: list[Datum], unit: Unit, pad_id: int, device: torch.device,
         weights: Sequence[float] | None = None) -> Packed:
    """Tensors for one micro-batch (see `Packed`); the prefix layout matches the sampler's.
    `weights[i]` is datum i's aggregation weight (1 where None)."""
    splits = [split_point(datums[i]) for i in unit.index]
    prefixes: dict[tuple[int, ...], int] = {}
    row_prefix = [prefixes.setdefault(tuple(datums[i].input_tokens[:s]), len(prefixes))
                  for i, s in zip(unit.index, splits, strict=True)]
    width = max(len(datums[i]) - s for i, s in zip(unit.index, splits, strict=True))
    b = len(unit.index)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    suffix_mask = torch.zeros((b, width), dtype=torch.long)
    keep = torch.zeros((b, width), dtype=torch.bool)
    targets, old, adv, where, seq, in_ratio = [], [], [], [], [], []
    for row, (i, s) in enumerate(zip(unit.index, splits, strict=True)):
        d = datums[i]
        ids[row, :len(d) - s] = torch.tensor(d.input_tokens[s:], dtype=torch.long)
        suffix_mask[row, :len(d) - s] = 1
        ratio_mask = d.ratio_mask or d.mask
        for pos in range(s, len(d)):
            if d.mask[pos] > 0:
                keep[row, pos - s] = True
                targets.append(d.target_tokens[pos])
                old.append(d.logprobs[pos])
                adv.append(d.advantages[pos])
                where.append((i, pos))
                seq.append(row)
                in_ratio.append(ratio_mask[pos] != 0)
    starts = torch.tensor(splits, dtype=torch.long)[:, None]
    prefix_ids = prefix_mask = None
    if any(splits):
        from retrain.backends.local.sampling.exact import left_pad

        prefix_ids, prefix_mask, _ = left_pad([list(p) for p in prefixes], pad_id, device)
    return Packed(prefix_ids=prefix_ids, prefix_mask=prefix_mask,
                  row_prefix=torch.tensor(row_prefix, dtype=torch.long, device=device),
                  input_ids=ids.to(device), suffix_mask=suffix_mask.to(device),
                  positions=(starts + torch.arange(width)[None, :]).to(device),
                  keep=keep.to(device),
                  targets=torch.tensor(targets, dtype=torch.long, device=device),
                  old_logprobs=torch.tensor(old, dtype=torch.float32, device=device),
                  advantages=torch.tensor(adv, dtype=torch.float32, device=device),
                  where=where,
                  weights=torch.tensor([1.0 if weights is None else weights[i] for i, _ in where],
                                       dtype=torch.float32, device=device),
                  seq=torch.tensor(seq, dtype=torch.long, device=device),
                  in_ratio=torch.tensor(in_ratio, dtype=torch.bool, device=device))


class GradDiagnostics:
    """Each micro-batch's own gradient on the adapter's parameters, for the gradient noise
    scale and coherence (seed 003). A micro-batch adds `sum(loss) / total tokens` to the
    accumulated gradient, so its own token-mean gradient is that increment x total / its tokens.
    """

    def __init__(self, params: list[torch.nn.Parameter], total_tokens: int,
                 micro_batches: int = 2):
        """`micro_batches` < 2: there is nothing to compare, so no flat copy of the gradient
        is made (with full fine-tuning each is as large as the model); only the count is
        reported, as always for one micro-batch."""
        self.params, self.total_tokens = params, total_tokens
        self.active = micro_batches >= 2
        self.start = self.previous = self._accumulated() if self.active else torch.zeros(0)
        self.sq_norms: list[float] = []
        self.tokens: list[int] = []
        self.cosines: list[float] = []
        self.last: torch.Tensor | None = None

    def _accumulated(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                          .detach().reshape(-1).float() for p in self.params])

    def after_micro_batch(self, tokens: int) -> None:
        if not self.active:
            self.tokens.append(tokens)
            return
        now = self._accumulated()
        g = (now - self.previous) * (self.total_tokens / tokens)
        self.previous = now
        self.sq_norms.append(float(g.dot(g)))
        self.tokens.append(tokens)
        if self.last is not None:
            self.cosines.append(float(torch.nn.functional.cosine_similarity(g, self.last, dim=0)))
        self.last = g

    def metrics(self) -> dict[str, float]:
        """Raw measurements for control.gradnoise.GradStats (only the count with one batch)."""
        k = len(self.tokens)
        if k < 2:
            return {"grad_micro_batches": float(k)}
        whole = self.previous - self.start
        return {"grad_micro_batches": float(k),
                "grad_small_sq_norm": sum(self.sq_norms) / k,
                "grad_small_tokens": k / sum(1.0 / t for t in self.tokens),
                "grad_big_sq_norm": float(whole.dot(whole)),
                "grad_big_tokens": float(sum(self.tokens)),
                "grad_coherence": sum(self.cosines) / len(self.cosines)}

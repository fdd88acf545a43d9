"""A micro-batch's datums as tensors, in one of two layouts (forward.py runs them).

Both give the loss-carrying targets (`Targets`) in the order the forward yields their
log-probs; the aggregation weight of each (algorithms/aggregation.py: the call's normaliser
is decided once over the whole call, each micro-batch adds its share) rides along, so
splitting into micro-batches never changes the result (up to float rounding).

**prefix** (`pack`): the completions of one group share their prompt, so a micro-batch runs
each distinct prompt *prefix* once (left-padded together, with gradients), repeats its KV
cache for its completions, and runs the per-completion *suffixes* on top: two forward calls
per micro-batch, the same layout as the sampler. The gradient is exactly that of running
every full sequence (causal attention: the prompt never sees its completion). Completions
differ in length (EOS), and padding every suffix to the longest wasted 37-63% of the suffix
tokens in a 4x8 SmolLM2 step, so the suffixes run in a few buckets of similar length
(`length_buckets`), each on its own copy of the prefix cache.

**packed** (`pack_rows`): whole sequences (prompt and completion) side by side in rows of
the micro-batch's longest sequence, first fit by decreasing length, no padding between them;
`position_ids` restart at 0 for each sequence (and for a row's unused tail, which carries no
target), so attention stays inside each sequence (forward.py says how). One forward call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from retrain.backends.base import BackendError, Datum
from retrain.backends.local.training.plan import Unit, split_point

BUCKET_OVERHEAD = 16      # padded token-rows that one more suffix forward (its fixed cost) is worth


@dataclass
class Targets:
    """A micro-batch's loss-carrying targets, in the order its forward yields them."""

    tokens: torch.Tensor              # (n,) target token ids
    old_logprobs: torch.Tensor        # (n,) the sampler's
    advantages: torch.Tensor          # (n,)
    weights: torch.Tensor             # (n,) the aggregation weight of each entry's datum
    seq: torch.Tensor                 # (n,) which sequence of the micro-batch (0..sequences-1)
    in_ratio: torch.Tensor            # (n,) bool: counts in its sequence's gspo ratio
    ref_logprobs: torch.Tensor | None  # (n,) the reference model's, for the KL term
    where: list[tuple[int, int]]      # (datum index, target position) of each entry
    sequences: int


def targets(datums: list[Datum], order: list[int], device: torch.device,
            weights: Sequence[float] | None = None, with_ref: bool = False) -> Targets:
    """The loss-carrying targets of datums `order` (each in position order), datum i weighing
    `weights[i]` (1 where None); `with_ref`: with their reference log-probs (KL term)."""
    where = [(i, pos) for i in order for pos, m in enumerate(datums[i].mask) if m > 0]
    seq_of = {i: k for k, i in enumerate(order)}
    if with_ref:
        missing = [i for i in order if datums[i].ref_logprobs is None]
        if missing:
            raise BackendError(f"datum {missing[0]} has no ref_logprobs for the KL term")

    def floats(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    ratio_masks = {i: datums[i].ratio_mask or datums[i].mask for i in order}
    return Targets(
        tokens=torch.tensor([datums[i].target_tokens[p] for i, p in where], dtype=torch.long,
                            device=device),
        old_logprobs=floats([datums[i].logprobs[p] for i, p in where]),
        advantages=floats([datums[i].advantages[p] for i, p in where]),
        weights=floats([1.0 if weights is None else weights[i] for i, _ in where]),
        seq=torch.tensor([seq_of[i] for i, _ in where], dtype=torch.long, device=device),
        in_ratio=torch.tensor([ratio_masks[i][p] != 0 for i, p in where], dtype=torch.bool,
                              device=device),
        ref_logprobs=floats([datums[i].ref_logprobs[p] for i, p in where]) if with_ref
        else None,
        where=where, sequences=len(order))


@dataclass
class Packed:
    """The prefix layout: distinct prefixes (left-padded) + suffixes (right-padded)."""

    prefix_ids: torch.Tensor | None   # (P, Lp) distinct prompt prefixes, or None if empty
    prefix_mask: torch.Tensor | None  # (P, Lp)
    row_prefix: torch.Tensor          # (b,) which prefix each suffix row continues
    input_ids: torch.Tensor           # (b, W) suffix tokens
    suffix_mask: torch.Tensor         # (b, W)
    positions: torch.Tensor           # (b, W) position ids of the suffix tokens
    keep: torch.Tensor                # (b, W) bool: targets that carry loss
    lengths: list[int]                # (b,) each suffix's length
    t: Targets                        # row-major over `keep`


def pack(datums: list[Datum], unit: Unit, pad_id: int, device: torch.device,
         weights: Sequence[float] | None = None, with_ref: bool = False) -> Packed:
    """Tensors for one micro-batch in the prefix layout; the prefix layout matches the
    sampler's."""
    splits = [split_point(datums[i]) for i in unit.index]
    prefixes: dict[tuple[int, ...], int] = {}
    row_prefix = [prefixes.setdefault(tuple(datums[i].input_tokens[:s]), len(prefixes))
                  for i, s in zip(unit.index, splits, strict=True)]
    lengths = [len(datums[i]) - s for i, s in zip(unit.index, splits, strict=True)]
    width = max(lengths)
    b = len(unit.index)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    suffix_mask = torch.zeros((b, width), dtype=torch.long)
    keep = torch.zeros((b, width), dtype=torch.bool)
    for row, (i, s) in enumerate(zip(unit.index, splits, strict=True)):
        d = datums[i]
        ids[row, :len(d) - s] = torch.tensor(d.input_tokens[s:], dtype=torch.long)
        suffix_mask[row, :len(d) - s] = 1
        keep[row, :len(d) - s] = torch.tensor(d.mask[s:]) > 0
    starts = torch.tensor(splits, dtype=torch.long)[:, None]
    prefix_ids = prefix_mask = None
    if any(splits):
        from retrain.backends.local.sampling.exact import left_pad

        prefix_ids, prefix_mask, _ = left_pad([list(p) for p in prefixes], pad_id, device)
    return Packed(prefix_ids=prefix_ids, prefix_mask=prefix_mask,
                  row_prefix=torch.tensor(row_prefix, dtype=torch.long, device=device),
                  input_ids=ids.to(device), suffix_mask=suffix_mask.to(device),
                  positions=(starts + torch.arange(width)[None, :]).to(device),
                  keep=keep.to(device), lengths=lengths,
                  t=targets(datums, unit.index, device, weights, with_ref))


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
class Rows:
    """The packed layout: whole sequences side by side, positions restarting per sequence."""

    input_ids: torch.Tensor           # (R, C) the rows' tokens (pad in a row's unused tail)
    positions: torch.Tensor           # (R, C) 0.. for each sequence, and for the tail
    keep: torch.Tensor                # (R, C) bool: targets that carry loss
    rows: list[list[int]]             # each row's datums, in order
    t: Targets                        # row-major over `keep`


def fill_rows(lengths: dict[int, int], capacity: int) -> list[list[int]]:
    """Datums into rows of `capacity` positions: first fit, longest first (ties by index)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(lengths, key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


def pack_rows(datums: list[Datum], unit: Unit, pad_id: int, device: torch.device,
              weights: Sequence[float] | None = None, with_ref: bool = False) -> Rows:
    """Tensors for one micro-batch in the packed layout (rows as long as its longest
    sequence)."""
    lengths = {i: len(datums[i]) for i in unit.index}
    capacity = max(lengths.values())
    rows = fill_rows(lengths, capacity)
    ids = torch.full((len(rows), capacity), pad_id, dtype=torch.long)
    positions = torch.zeros((len(rows), capacity), dtype=torch.long)
    keep = torch.zeros((len(rows), capacity), dtype=torch.bool)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            d, n = datums[i], lengths[i]
            ids[r, at:at + n] = torch.tensor(d.input_tokens, dtype=torch.long)
            positions[r, at:at + n] = torch.arange(n)
            keep[r, at:at + n] = torch.tensor(d.mask) > 0
            at += n
        positions[r, at:] = torch.arange(capacity - at)
    order = [i for row in rows for i in row]
    return Rows(input_ids=ids.to(device), positions=positions.to(device),
                keep=keep.to(device), rows=rows,
                t=targets(datums, order, device, weights, with_ref))

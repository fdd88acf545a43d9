"""Micro-batches of one forward_backward call, planned from what the device has free.

A micro-batch is bounded by a `Budget`: the positions it runs (padding included) and, where
the LM head is not run in chunks, the logit entries it holds (loss-carrying targets x vocab).

- CPU (and MPS): the budgets measured on the CPU, `AUTO_TOKENS` padded suffix tokens and
  `AUTO_LOGITS` logit entries: a CPU step is matmul work, so a larger micro-batch wins
  nothing and only costs memory.
- CUDA: what the device has free (`torch.cuda.mem_get_info`, plus what torch's caching
  allocator holds unused; the sampler's caches are allocated, so they are already taken),
  less the gradients the first backward will allocate, x (1 - `HEADROOM`), divided by what one
  token costs: its saved activations, measured once on the model by a probe forward
  (`saved_bytes_per_token`), x `TRANSIENT` for what the backward holds beside them. At most
  `MAX_TOKENS` positions: beyond that a micro-batch no longer runs faster (the kernels are
  long since saturated) and only the peak memory grows.

`[training] micro_batch_size` > 0 overrides the budget (that many sequences a micro-batch);
an out-of-memory error halves the largest micro-batch and plans again (backend.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from retrain.backends.base import Datum

AUTO_TOKENS = 8192        # CPU: padded suffix tokens per micro-batch
AUTO_LOGITS = 2**26       # CPU: logit entries (loss-carrying targets x vocab) per micro-batch
HEADROOM = 0.3            # CUDA: the share of free memory the plan leaves unused
TRANSIENT = 1.25          # CUDA: peak / saved activations (gradients in flight, logits chunk)
MAX_TOKENS = 32768        # CUDA: positions per micro-batch at most
PROBE_TOKENS = 64         # tokens of the probe forward that measures saved bytes per token


@dataclass(frozen=True)
class Budget:
    """What one micro-batch may run: `tokens` positions (padding included) and, unless the
    LM head runs in chunks (None), `logits` logit entries at once."""

    tokens: int
    logits: int | None


def cpu_budget() -> Budget:
    """The CPU's budgets. The logits bound holds even where the LM head runs in chunks (of
    AUTO_LOGITS entries, logprobs.CHUNK_ENTRIES): a CPU micro-batch is one chunk, as before."""
    return Budget(AUTO_TOKENS, AUTO_LOGITS)


def memory_budget(free_bytes: int, token_bytes: int, chunked_head: bool,
                  headroom: float = HEADROOM) -> Budget:
    """The budget of a device with `free_bytes` free when a token costs `token_bytes` saved
    activations: positions whose peak (x TRANSIENT) fits (1 - headroom) of the free memory,
    at most MAX_TOKENS, at least one sequence's worth (an out-of-memory error then halves)."""
    usable = max(0.0, free_bytes * (1.0 - headroom))
    tokens = int(usable // max(1.0, token_bytes * TRANSIENT))
    tokens = max(1, min(MAX_TOKENS, tokens))
    logits = None if chunked_head else max(1, int(usable // 16))  # fp32 logits, lse and grad
    return Budget(tokens, logits)


def free_bytes(device: torch.device, pending: int = 0) -> int:
    """What a training pass may allocate on a CUDA `device`: free memory, plus what torch's
    caching allocator holds unused, less `pending` bytes still to be allocated (gradients)."""
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(0, int(free + cached - pending))


def saved_bytes_per_token(body: Any, device: torch.device) -> int:
    """Bytes of activations a training forward of `body` (the model, or the model without its
    LM head) saves for the backward, per token: counted by saved-tensor hooks (each storage
    once, parameters not) over a probe forward of PROBE_TOKENS random embeddings that want a
    gradient, so that every layer saves what full fine-tuning saves (an upper bound for LoRA,
    and the same whichever adapter is active or frozen); its graph is dropped."""
    params = {p.untyped_storage().data_ptr() for p in body.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    embed = body.get_input_embeddings()
    gen = torch.Generator(device).manual_seed(0)
    ids = torch.randint(0, embed.weight.shape[0], (1, PROBE_TOKENS), device=device, generator=gen)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        embeds = embed(ids).detach().requires_grad_(True)
        body(inputs_embeds=embeds, use_cache=False)
    return math.ceil(sum(seen.values()) / PROBE_TOKENS)


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


@dataclass
class _Open:
    """The micro-batch being filled: its rows, longest suffix, positions and kept targets."""

    rows: int = 0
    width: int = 0
    positions: int = 0
    kept: int = 0


def plan(datums: list[Datum], size: int, budget: Budget, vocab_size: int,
         packed: bool = False) -> list[Unit]:
    """Micro-batches of at most `size` datums (0 = within `budget`), prompt-mates together.

    The positions a micro-batch runs: its suffixes padded to the longest (the prefix layout,
    `packed` False) or its whole sequences (packed rows). Packed plans are balanced: as many
    micro-batches as the budget needs, each of about the same positions. Datums without
    loss-carrying targets are left out (they add nothing to the gradient); datums whose prefix
    is empty (one-token prompts) get micro-batches of their own in the prefix layout.
    """
    keyed = []
    for i, d in enumerate(datums):
        s = split_point(d)
        if s < len(d.mask):
            keyed.append((s == 0 and not packed, tuple(d.input_tokens[:s]), len(d), i,
                          len(d) - s, sum(1 for m in d.mask[s:] if m > 0)))
    keyed.sort()
    units = _greedy(keyed, size, budget, vocab_size, packed)
    if packed and size <= 0 and len(units) > 1:
        # each full micro-batch then holds more than total / k: k at most, of even size
        even = math.ceil(sum(k[2] for k in keyed) / len(units)) + max(k[2] for k in keyed)
        units = _greedy(keyed, size, Budget(min(budget.tokens, even), budget.logits),
                        vocab_size, packed)
    return units


def _greedy(keyed: list[tuple], size: int, budget: Budget, vocab_size: int,
            packed: bool) -> list[Unit]:
    """The sorted datums (`plan`'s keys) in order, a new micro-batch where one is full."""
    units: list[Unit] = []
    current: list[int] = []
    unit, unit_empty = _Open(), False
    for empty, _, length, i, suffix, targets in keyed:
        grown = _Open(unit.rows + 1, max(unit.width, suffix), unit.positions + length,
                      unit.kept + targets)
        if current and (empty != unit_empty or not _fits(grown, size, budget, vocab_size,
                                                          packed)):
            units.append(Unit(current))
            current, grown = [], _Open(1, suffix, length, targets)
        current.append(i)
        unit, unit_empty = grown, empty
    if current:
        units.append(Unit(current))
    return units


def _fits(unit: _Open, size: int, budget: Budget, vocab_size: int, packed: bool) -> bool:
    """Whether a micro-batch fits: `size` rows, or the budget's positions (padded suffixes,
    an upper bound of the length buckets, or whole packed sequences) and, where the head is
    not chunked, the logits of its loss-carrying targets (`logits_to_keep`: not padded rows)."""
    if size > 0:
        return unit.rows <= size
    positions = unit.positions if packed else unit.width * unit.rows
    return positions <= budget.tokens and (budget.logits is None
                                           or unit.kept * vocab_size <= budget.logits)

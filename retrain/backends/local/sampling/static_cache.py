"""The fast sampler's static KV cache: buffers allocated once per (bucket, capacity) shape.

Every layer's keys and values live in `[bucket, kv_heads, capacity, head_dim]` buffers; a
decoding step writes its token's column in place at a position held in a device tensor, and
attention reads the buffers through a mask of the filled columns. Nothing changes shape or
address from one step to the next, which is what a CUDA graph needs (it records addresses).

- `bucket`: rows, a power of two at least the live rows; padding rows repeat row 0.
- `capacity`: columns, prompt width + max_tokens rounded up to `CAPACITY_STEP`, so that
  calls with similar prompts share one shape.
- When the live rows fit the next smaller bucket, they are compacted into that shape's
  buffers (`compact`); finished rows keep their slot until then.
- The pool's states together hold at most `CACHE_SHARE` of the device memory they may use
  (what is free, PyTorch's cached blocks included, plus what the pool holds): the least
  recently used shapes are let go first, and a decode whose rows do not fit runs in several
  passes (`StatePool.max_bucket`). The rest stays free for the step's activations and
  logits, the prefill's cache and training. Off the GPU there is no such bound.

The layout, `[bucket, kv_heads, capacity, head_dim]` per layer, serves few KV heads
(SmolLM2: 3, Qwen2.5: 2) and many (Qwen3: 8 of size 128) alike: a decoding step reads each
KV head's filled columns once for all the query heads of its group.

Buffers start at zero: a masked column's weight is exactly 0, but 0 x NaN would still be NaN.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

CAPACITY_STEP = 64
MIN_BUCKET = 4
MAX_BUCKET = 1 << 16
MAX_SHAPES = 16  # shapes kept in the pool; the least recently used is dropped beyond
CACHE_SHARE = 0.5  # of the device memory free for the pool (its own included)


def bucket_for(rows: int) -> int:
    """The smallest power of two that holds `rows` (at least MIN_BUCKET)."""
    return max(MIN_BUCKET, 1 << max(rows - 1, 0).bit_length())


def capacity_for(width: int, max_tokens: int) -> int:
    return -(-(width + max_tokens) // CAPACITY_STEP) * CAPACITY_STEP


@dataclass(frozen=True)
class Geometry:
    """What a cache layer looks like: layers, KV heads, head size, dtype and device."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def state_bytes(self, bucket: int, capacity: int) -> int:
        """Device bytes of a `StaticState` of this shape: keys and values of every layer,
        plus the per-column mask, draws and output buffers (bool, float64, int64, float32)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        kv = 2 * self.layers * self.kv_heads * self.head_dim * element
        return bucket * capacity * (kv + 1 + 8 + 8 + 4) + bucket * 4 * 8


class StaticState:
    """All of a decode's device state for one shape; a graph captured on it stays valid."""

    def __init__(self, geo: Geometry, bucket: int, capacity: int):
        z = {"device": geo.device}
        shape = (bucket, geo.kv_heads, capacity, geo.head_dim)
        self.bucket, self.capacity = bucket, capacity
        self.k = [torch.zeros(shape, dtype=geo.dtype, **z) for _ in range(geo.layers)]
        self.v = [torch.zeros(shape, dtype=geo.dtype, **z) for _ in range(geo.layers)]
        self.valid = torch.zeros((bucket, capacity), dtype=torch.bool, **z)  # filled columns
        self.tok = torch.zeros(bucket, dtype=torch.long, **z)       # the token to feed next
        self.pos = torch.zeros(bucket, dtype=torch.long, **z)       # its position id
        self.keys = torch.zeros((bucket, 2), dtype=torch.long, **z)  # counter_rng row keys
        self.u = torch.zeros((bucket, capacity), dtype=torch.float64, **z)  # draws by step
        self.col = torch.zeros((), dtype=torch.long, **z)  # the cache column it is written to
        self.step = torch.zeros((), dtype=torch.long, **z)  # the step whose token is drawn
        self.out_tok = torch.zeros((bucket, capacity), dtype=torch.long, **z)
        self.out_lp = torch.zeros((bucket, capacity), dtype=torch.float32, **z)

    def rows(self) -> list[torch.Tensor]:
        """The per-row buffers, in the order `compact` moves them."""
        return [*self.k, *self.v, self.valid, self.tok, self.pos, self.keys, self.u,
                self.out_tok, self.out_lp]

    def fill(self, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor,
             rows: torch.Tensor) -> None:
        """Load a prefill: `keys`/`values` [prompts, kv, width, hd] per layer, `mask`
        [prompts, width]; bucket row i takes prompt `rows[i]`'s cache."""
        width = mask.shape[1]
        for buf, src in zip(self.k + self.v, keys + values, strict=True):
            buf[:, :, :width].copy_(src[rows])
        self.valid.zero_()
        self.valid[:, :width].copy_(mask[rows].bool())
        self.pos.copy_(mask[rows].sum(dim=1))
        self.col.fill_(width)
        self.step.zero_()


def compact(src: StaticState, dst: StaticState, keep: torch.Tensor) -> None:
    """Move rows `keep` of `src` into the first rows of `dst` (same capacity, smaller
    bucket); `dst`'s other rows repeat the first kept row (padding that stays finite)."""
    idx = torch.cat([keep, keep[:1].expand(dst.bucket - keep.numel())])
    for a, b in zip(src.rows(), dst.rows(), strict=True):
        b.copy_(a[idx])
    dst.col.copy_(src.col)
    dst.step.copy_(src.step)


def device_free_bytes(device: torch.device) -> int | None:
    """Bytes the pool may still take on `device`: free device memory plus PyTorch's cached
    blocks not in use; None off CUDA (no bound)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class StatePool:
    """Static states by (bucket, capacity), allocated on first use and reused after, within
    `CACHE_SHARE` of the memory `free_bytes()` says is left (None: no bound)."""

    def __init__(self, geo: Geometry,
                 free_bytes: Callable[[], int | None] | None = None):
        self.geo = geo
        self.free_bytes = free_bytes or (lambda: device_free_bytes(geo.device))
        self.states: OrderedDict[tuple[int, int], StaticState] = OrderedDict()
        self.dropped: list[tuple[int, int]] = []  # shapes let go (their graphs must go too)

    def held(self) -> int:
        return sum(self.geo.state_bytes(*key) for key in self.states)

    def budget(self) -> int | None:
        """Bytes the pool's states may hold in all, None without a bound."""
        free = self.free_bytes()
        return None if free is None else int((free + self.held()) * CACHE_SHARE)

    def max_bucket(self, capacity: int) -> int | None:
        """The largest bucket of `capacity` columns the budget holds (0: not even
        MIN_BUCKET rows; None: no bound)."""
        budget = self.budget()
        if budget is None:
            return None
        bucket = 0
        while bucket < MAX_BUCKET and \
                self.geo.state_bytes(max(bucket * 2, MIN_BUCKET), capacity) <= budget:
            bucket = max(bucket * 2, MIN_BUCKET)
        return bucket

    def get(self, bucket: int, capacity: int) -> StaticState:
        key = (bucket, capacity)
        state = self.states.get(key)
        if state is None:
            self._make_room(self.geo.state_bytes(bucket, capacity))
            state = self.states[key] = StaticState(self.geo, bucket, capacity)
            while len(self.states) > MAX_SHAPES:
                self._drop_oldest()
        self.states.move_to_end(key)
        return state

    def _make_room(self, need: int) -> None:
        """Let the least recently used states go until `need` more bytes fit the budget."""
        budget = self.budget()
        while budget is not None and self.states and self.held() + need > budget:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        old, _ = self.states.popitem(last=False)
        self.dropped.append(old)

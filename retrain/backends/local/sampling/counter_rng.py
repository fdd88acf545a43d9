"""A counter-based random draw: u = f(seed, prompt, sample, step), computed on the device.

The fast sampler (`sampling.fast`) cannot use per-row `torch.Generator`s: they mean a
Python loop per step, and a CUDA graph cannot capture them. Here a row's uniform for a step
is a hash of its key (seed, prompt, sample) and the step number: pure tensor arithmetic,
capturable, and the same for a row whatever else shares the batch or when the others end.

The hash works on 32-bit words held in int64 tensors: every multiplier is odd and below 2**31,
so a product of a 32-bit word and a multiplier stays below 2**63 (no signed overflow, the same
numbers on every device). Each round (xorshift, multiply, mask) is a bijection of 32 bits.
Row keys are mixed on the host with Python's exact integers (splitmix64).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_M1 = 0x7FEB352D  # odd multipliers below 2**31 (see the docstring)
_M2 = 0x2C1B3C6D
_M3 = 0x5BD1E995


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_key(seed: int, prompt: int, sample: int) -> int:
    """A row's 64-bit key: its seed, its prompt's number and its sample's number, mixed."""
    key = _splitmix64(seed & _MASK64)
    key = _splitmix64(key ^ (prompt & _MASK64))
    return _splitmix64(key ^ (sample & _MASK64))


def row_keys(seeds: Sequence[int], prompt_ids: Sequence[int], n: int,
             device: torch.device) -> torch.Tensor:
    """[rows, 2] int64: each row's key as two 32-bit words; row p*n + j is prompt p's sample j."""
    words = []
    for seed, prompt in zip(seeds, prompt_ids, strict=True):
        for j in range(n):
            key = row_key(seed, prompt, j)
            words.append((key >> 32, key & _MASK32))
    return torch.tensor(words, dtype=torch.long, device=device).reshape(-1, 2)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    x = x ^ (x >> 13)
    x = (x * _M3) & _MASK32
    return x ^ (x >> 16)


def uniforms(keys: torch.Tensor, step: torch.Tensor | int) -> torch.Tensor:
    """Each row's uniform in (0, 1] (float64, 53 random bits) for `step`: `keys` [rows, 2]
    from `row_keys`, `step` an int or a 0-d int64 tensor on the keys' device (a graph's
    step counter)."""
    step = torch.as_tensor(step, dtype=torch.long, device=keys.device)
    return _uniforms(keys[:, 0], keys[:, 1], step)


def uniforms_block(keys: torch.Tensor, steps: int) -> torch.Tensor:
    """[rows, steps]: each row's uniforms for steps 0 .. steps - 1 at once, bit for bit
    `uniforms(keys, s)` for each s (the fast sampler draws a whole decode's up front, so a
    decoding step reads its column instead of running the ~60 small hashing ops)."""
    step = torch.arange(steps, dtype=torch.long, device=keys.device)[None, :]
    return _uniforms(keys[:, :1], keys[:, 1:], step)


def _uniforms(hi: torch.Tensor, lo: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    base = _mix32(lo ^ _mix32(hi ^ _mix32(step & _MASK32)))
    a = _mix32(base ^ 0x3C6EF372)
    b = _mix32(a ^ base ^ 0x1B873593)
    bits = (a >> 5) * (1 << 26) + (b >> 6)  # 27 + 26 = 53 bits
    return (bits + 1).to(torch.float64) / float(1 << 53)


class CounterDraws:
    """The counter draws as a stream of steps, for a sampler that asks for each step's
    uniforms in turn (`sampling.exact.step_uniforms`): today's loop with these draws is
    the reference the fast sampler is tested against."""

    def __init__(self, seeds: Sequence[int], prompt_ids: Sequence[int], n: int,
                 device: torch.device):
        self.keys = row_keys(seeds, prompt_ids, n, device)
        self.step = 0

    def step_uniforms(self, total: int, device: torch.device) -> torch.Tensor:
        if total != self.keys.shape[0]:
            raise ValueError(f"CounterDraws: {self.keys.shape[0]} rows, asked for {total}")
        u = uniforms(self.keys.to(device), self.step)
        self.step += 1
        return u

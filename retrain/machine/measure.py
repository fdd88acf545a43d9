"""Measure what this machine computes: matmul throughput at given shapes, memory bandwidth.

Both are best-of-several timings (the machine's capability, not its average under load).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

CANONICAL = (256, 1024, 4096)  # (rows, in, out): a mid-sized layer, for the machine's peak


@dataclass(frozen=True)
class Gemm:
    """`count` products of an (m x k) input with a (k x n) weight, as `nn.Linear` computes."""

    m: int
    k: int
    n: int
    count: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n * self.count


def best_seconds(fn: Callable[[], object], repeat: int = 5, min_time: float = 0.05) -> float:
    """The fastest of `repeat` timings of `fn` (after a warm-up), each run long enough to
    time: `fn` is called as often as `min_time` needs, and the per-call time returned."""
    fn()
    start, calls = time.perf_counter(), 0
    while calls == 0 or time.perf_counter() - start < min_time:
        fn()
        calls += 1
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def gemm_gflops(shapes: list[Gemm], dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", repeat: int = 5) -> float:
    """GFLOP/s of running every shape `count` times (the shapes of one model pass), each
    with its own weight, as a model's layers have: weights larger than the caches stream from
    memory as they do in the model."""
    gen = torch.Generator().manual_seed(0)
    pairs = [(torch.randn(s.m, s.k, generator=gen).to(device, dtype),
              [torch.randn(s.n, s.k, generator=gen).to(device, dtype) for _ in range(s.count)])
             for s in shapes]

    def sweep() -> None:
        with torch.inference_mode():
            for x, weights in pairs:
                for w in weights:
                    torch.nn.functional.linear(x, w)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()

    return sum(s.flops for s in shapes) / best_seconds(sweep, repeat) / 1e9


def bandwidth_gb_s(megabytes: int = 256, device: str | torch.device = "cpu",
                   repeat: int = 5) -> float:
    """GB/s of a large copy (bytes read plus bytes written), far above the caches."""
    n = megabytes * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()

    return 2.0 * src.numel() * 4 / best_seconds(copy, repeat) / 1e9


def peak_gflops(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> float:
    """GFLOP/s of the canonical mid-sized matmul (`CANONICAL`)."""
    return gemm_gflops([Gemm(*CANONICAL)], dtype, device)

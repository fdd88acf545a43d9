"""CUDA graphs of the fast sampler's decoding step, one per shape, captured lazily.

The first time a key (shape, window, sampling settings, adapter) is stepped, the step runs
eagerly on a side stream (the warm-up PyTorch asks for, and a real step: capturing does
not execute anything), then it is captured; every later step with that key is a replay.
All graphs share one memory pool. A graph records addresses, not values: the weights and the
static state may change in place (an AdamW step, a merged-weight refresh), but a tensor that
is replaced (a reloaded model, a state dropped from the pool) invalidates its graphs:
`drop` and `clear` let them go.

Only on CUDA; elsewhere the sampler calls the step itself.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch


def available(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


class StepGraphs:
    """Captured decoding steps by key."""

    def __init__(self) -> None:
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.captures = 0
        self.replays = 0

    def run(self, key: Hashable, step: Callable[[], None]) -> None:
        """One decoding step: a replay of `key`'s graph, or (the first time) an eager step
        and the capture."""
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            self.replays += 1
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            step()
        self._pool = graph.pool()
        self.graphs[key] = graph
        self.captures += 1

    def drop(self, match: Callable[[Hashable], bool]) -> None:
        for key in [k for k in self.graphs if match(k)]:
            del self.graphs[key]

    def clear(self) -> None:
        self.graphs.clear()
        self._pool = None

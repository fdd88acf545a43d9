"""`[backend] compile`: torch.compile of the local sampler's decoding step.

The decoding step (one new token for every row, through the model and its KV cache) is the
call the sampler makes `max_tokens` times. `CompiledDecoder` runs it through
`torch.compile(net, dynamic=True)`: rows leaving the batch and the cache growing by a token
are symbolic sizes, so it compiles a couple of times (the first shapes, then the general
ones) and never per step. Prefill and training stay eager.

A compile that fails (no C++ compiler for the CPU inductor, an op it cannot lower, ...)
costs one line on stderr and the step runs eagerly from then on: the same model, the same
numbers to within float rounding (tests/test_local_compile.py checks the log-probs).

"auto" is what the measurements say: off. On the 2-core CPU measured (bench/RESULTS.md,
2026-11-25) SmolLM2-135M's compiled step was no faster than eager (3% slower, step by
step), after 3.5 minutes of compiling; the step is matmul work that compiling cannot speed
up. Where the Python overhead dominates (the tiny test model) it was 1.6x faster per step,
but such a run never pays back its compile. GPUs were not measured.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO


def wanted(setting: bool | str) -> bool:
    """Whether `[backend] compile` asks for the compiled decoding step ("auto": see above)."""
    return setting is True


class CompiledDecoder:
    """`net(**kwargs)` through its compiled forward; eager for good after a failed compile."""

    def __init__(self, net: Any, say: TextIO | None = None,
                 compile_fn: Callable[..., Any] | None = None):
        import torch

        self.net = net
        self.say = say
        self.failed: str | None = None
        self._compiled = (compile_fn or torch.compile)(net, dynamic=True)

    def __call__(self, **kwargs: Any) -> Any:
        import torch

        if self.failed is None:
            try:
                return self._compiled(**kwargs)
            except torch.OutOfMemoryError:  # the step's, not the compiler's
                raise
            except Exception as exc:  # the compiler's, or the model's: eager raises it again
                self._fall_back(exc)
        return self.net(**kwargs)

    def _fall_back(self, exc: BaseException) -> None:
        exc = _root(exc)
        lines = str(exc).strip().splitlines()
        self.failed = f"{type(exc).__name__}: {lines[0][:200] if lines else ''}".rstrip(": ")
        print(f"compile: torch.compile of the decoding step failed ({self.failed}); "
              "decoding eagerly", file=self.say or sys.stderr, flush=True)


def _root(exc: BaseException) -> BaseException:
    """What the compiler raised, out of dynamo's wrapping (`inner_exception`, `__cause__`)."""
    inner = getattr(exc, "inner_exception", None) or exc.__cause__
    return exc if inner is None or inner is exc else _root(inner)

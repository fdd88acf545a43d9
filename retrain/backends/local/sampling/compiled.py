"""`[backend] compile`: torch.compile of the local sampler's decoding step.

The decoding step (one new token for every row, through the model and its KV cache) is the
call the sampler makes `max_tokens` times. `CompiledDecoder` runs it through
`torch.compile(net, dynamic=True)`: rows leaving the batch and the cache growing by a token
are symbolic sizes, so it compiles a couple of times (the first shapes, then the general
ones) and never per step. Prefill and training stay eager.

A compile that fails (no C++ compiler for the CPU inductor, an op it cannot lower, ...)
costs one line on stderr and the step runs eagerly from then on: the same model, the same
numbers to within float rounding (tests/backends/local/test_local_compile.py checks the
log-probs). So does a compiled step whose logits are not finite: the step is taken back from
the KV cache and run again eagerly, so a compiler's fault is never reported as diverged
weights (weights that did diverge are then caught by the eager step).

Inductor's on-disk cache does not tell CPU kernels apart by instruction set: kernels built
under AVX-512 and loaded under `ATEN_CPU_CAPABILITY=avx2` gave NaN logits, and the reverse
failed to build (torch 2.13, 2026-11-27). So, unless TORCHINDUCTOR_CACHE_DIR is set, the
cache lives under retrain's cache, one folder per instruction set.

"auto" is what the measurements say: off. On the 2-core CPU measured (bench/RESULTS.md,
2026-11-25) SmolLM2-135M's compiled step was no faster than eager (3% slower, step by
step), after 3.5 minutes of compiling; the step is matmul work that compiling cannot speed
up. Where the Python overhead dominates (the tiny test model) it was 1.6x faster per step,
but such a run never pays back its compile. GPUs were not measured.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def inductor_cache() -> Path:
    """Inductor's cache for this machine's instruction set, beside retrain's models."""
    import torch

    from retrain.backends.models import cache_dir

    return cache_dir().parent / "inductor" / torch.backends.cpu.get_cpu_capability().lower()


def _key_inductor_cache() -> None:
    """Point inductor at `inductor_cache()` unless the user chose a folder (inductor itself
    writes its default into the variable on first use, hence the comparison)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get(INDUCTOR_CACHE_ENV)
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ[INDUCTOR_CACHE_ENV] = str(inductor_cache())


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
        _key_inductor_cache()
        self._compiled = (compile_fn or torch.compile)(net, dynamic=True)

    def __call__(self, **kwargs: Any) -> Any:
        import torch

        if self.failed is None:
            try:
                out = self._compiled(**kwargs)
            except torch.OutOfMemoryError:  # the step's, not the compiler's
                raise
            except Exception as exc:  # the compiler's, or the model's: eager raises it again
                self._fall_back(_what(_root(exc)))
            else:
                if bool(torch.isfinite(out.logits).all()):
                    return out
                self._fall_back("its logits were not finite")
                _take_back(kwargs)
        return self.net(**kwargs)

    def _fall_back(self, why: str) -> None:
        self.failed = why
        print(f"compile: torch.compile of the decoding step failed ({why}); "
              "decoding eagerly", file=self.say or sys.stderr, flush=True)


def _take_back(kwargs: dict[str, Any]) -> None:
    """Remove the step's new positions from its KV cache, so that it can run again."""
    from transformers.cache_utils import Cache

    cache = next(v for v in kwargs.values() if isinstance(v, Cache))
    cache.crop(-int(kwargs["input_ids"].shape[1]))


def _what(exc: BaseException) -> str:
    """`Type: first line` of an exception, for the one line."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}".rstrip(": ")


def _root(exc: BaseException) -> BaseException:
    """What the compiler raised, out of dynamo's wrapping (`inner_exception`, `__cause__`)."""
    inner = getattr(exc, "inner_exception", None) or exc.__cause__
    return exc if inner is None or inner is exc else _root(inner)

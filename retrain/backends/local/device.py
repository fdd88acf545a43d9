"""Where the local backend computes: the device and weights dtype it picks, and torch's
out-of-memory errors (CUDA, MPS, CPU) turned into the contract's BackendOOMError."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from retrain.backends.base import BackendError, BackendOOMError
from retrain.errors import UserError
from retrain.machine.cpu import cpu_has_native_bf16

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def pick_device(device: str) -> torch.device:
    """`auto` = cuda, then mps, then cpu; an explicit device that is absent is an error."""
    has_mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if has_mps else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise BackendError("model.device = 'cuda' but torch sees no CUDA device")
    if device == "mps" and not has_mps:
        raise BackendError("model.device = 'mps' but MPS is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The weights dtype for `model.dtype` on `device`, and why (for the run log).

    `auto`: bfloat16 where the hardware computes it (CUDA with bf16, CPUs with AVX512-BF16, AMX
    or Arm BF16), else float32: emulated bfloat16 is several times slower than float32."""
    if dtype == "auto":
        if device.type == "cuda":
            fast = torch.cuda.is_bf16_supported()
            why = "auto: this GPU " + ("supports" if fast else "lacks") + " bfloat16"
        elif device.type == "cpu":
            fast = cpu_has_native_bf16()
            why = "auto: this CPU " + ("computes bfloat16 natively" if fast else
                                       "has no native bfloat16 (AVX512-BF16/AMX/Arm BF16)")
        else:
            fast, why = False, f"auto: float32 on {device.type}"
        return (torch.bfloat16 if fast else torch.float32), why
    if dtype == "bfloat16" and device.type == "cpu" and not cpu_has_native_bf16():
        return torch.bfloat16, ("as configured; this CPU has no native bfloat16, so it is "
                                "emulated and several times slower than float32: "
                                'model.dtype = "auto" picks float32 here')
    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype], "as configured"


def is_oom(exc: BaseException) -> bool:
    """CUDA/MPS/CPU allocation failures, which torch reports as (subclasses of) RuntimeError."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text
                                              or "can't allocate memory" in text)


@contextmanager
def oom_as_backend_error(what: str) -> Iterator[None]:
    try:
        yield
    except BackendError:
        raise
    except (RuntimeError, MemoryError) as exc:
        if isinstance(exc, MemoryError) or is_oom(exc):
            raise BackendOOMError(f"out of memory during {what}: {exc}") from exc
        raise

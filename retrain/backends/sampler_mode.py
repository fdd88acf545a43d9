"""`[backend] sampler`: which local sampler a run gets, and why. Pure (no torch), so
`retrain explain` can say it too.

- exact: `sampling.exact.sample_batch`, through the trainer's adapter modules, with
  torch.Generator draws (what every CPU result so far was measured with); on CUDA it reads
  the host every `EXACT_WINDOW` steps, on the CPU every step;
- fast: `sampling.fast.StaticSampler`, a static KV cache with LoRA merged into fixed
  buffers, k device steps per host look, CUDA graphs on CUDA, counter-based draws; for the
  model families in `FAST_FAMILIES` only;
- auto: exact on CPU and MPS (where a step is bound by its matmuls, not by launches), fast
  on CUDA when the model's family allows it, else exact (one line says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MODES = ("auto", "exact", "fast")
# transformers `model_type`s whose layout the fast decoding step (`decode_step.forward`)
# computes: rotary attention with grouped KV heads, RMSNorm, gated MLP; qwen3 adds RMSNorm
# on each query and key head and a head size that need not be hidden / heads
FAST_FAMILIES = ("llama", "qwen2", "qwen3")
# decoding steps the exact sampler runs between two host reads, by device type (default 1:
# every step; a CPU waits for its own matmuls anyway, and a longer window decodes finished
# rows for nothing). 16 = the fast sampler's CHECK_EVERY.
EXACT_WINDOW = {"cuda": 16}


@dataclass(frozen=True)
class Choice:
    """The sampler a run gets (`mode`) and the reason, in words."""

    mode: str
    why: str


def resolve(setting: str, device_type: str) -> str:
    """"exact" or "fast" for `setting` on a device of type `device_type` ("cpu", "cuda", ...),
    before the model is known."""
    if setting not in MODES:
        raise ValueError(f"backend.sampler: {setting!r} is not one of {', '.join(MODES)}")
    if setting != "auto":
        return setting
    return "fast" if device_type == "cuda" else "exact"


def family_problem(model_type: str | None,
                   layer_types: Sequence[str] | None = None) -> str | None:
    """Why the fast sampler cannot run a model of this family (None when it can, or when the
    family is not known: `None` model_type)."""
    if model_type is None:
        return None
    if model_type not in FAST_FAMILIES:
        return f"model type {model_type!r} (the fast sampler knows {', '.join(FAST_FAMILIES)})"
    if any(t != "full_attention" for t in layer_types or []):
        return "sliding-window attention layers"
    return None


def choose(setting: str, device_type: str, model_type: str | None,
           layer_types: Sequence[str] | None = None) -> Choice:
    """The sampler for `setting` on `device_type` and a model of `model_type` (None: not
    known yet), with the reason. Explicit "fast" on a family it cannot run is kept as "fast"
    here: the caller turns it into the config error."""
    mode = resolve(setting, device_type)
    problem = family_problem(model_type, layer_types)
    if setting == "exact":
        return Choice("exact", "asked for")
    if setting == "fast":
        return Choice("fast", f"asked for, but it cannot run {problem}: the run stops with "
                      "a config error (use sampler = \"exact\")" if problem else "asked for")
    if mode == "exact":
        return Choice("exact", f"auto on {device_type}: a step there is bound by its matmuls")
    if problem:
        return Choice("exact", f"auto on {device_type}, but the fast sampler cannot run "
                               f"{problem}")
    known = "" if model_type is None else f" and a {model_type} model"
    return Choice("fast", f"auto on {device_type}{known}")


def exact_window(device_type: str) -> int:
    """Decoding steps between the exact sampler's host reads on `device_type`."""
    return EXACT_WINDOW.get(device_type, 1)

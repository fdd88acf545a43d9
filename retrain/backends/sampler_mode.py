"""`[backend] sampler`: which local sampler a run uses. Pure (no torch), so `retrain explain`
can say it too.

- exact: `sampling.exact.sample_batch`, step by step through the trainer's adapter modules,
  with torch.Generator draws (what every CPU result so far was measured with);
- fast: `sampling.fast.StaticSampler`, a static KV cache with LoRA merged into fixed
  buffers, k device steps per host look, CUDA graphs on CUDA, counter-based draws;
- auto: exact on CPU and MPS (where a step is bound by its matmuls, not by launches), fast
  on CUDA.
"""

from __future__ import annotations

MODES = ("auto", "exact", "fast")


def resolve(setting: str, device_type: str) -> str:
    """"exact" or "fast" for `setting` on a device of type `device_type` ("cpu", "cuda", ...)."""
    if setting not in MODES:
        raise ValueError(f"backend.sampler: {setting!r} is not one of {', '.join(MODES)}")
    if setting != "auto":
        return setting
    return "fast" if device_type == "cuda" else "exact"

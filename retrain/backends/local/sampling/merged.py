"""`[backend] sampler = "fast"`: the sampler's LoRA merged into fixed weight buffers.

Each LoRA-wrapped linear layer gets one buffer, allocated once per adapter, holding
W + scale * B @ A; a graph captured on it records its address. `refresh` rewrites the
buffers in place, so the graphs stay valid: it runs before sampling whenever an adapter
parameter changed since the last refresh (torch bumps a tensor's `_version` on every in-place
update: an AdamW step, a `load_state`, a snapshot's copy). The merge is computed in float32
and rounded once to the weights' dtype, so in bfloat16 the sampler's log-probs differ from
the trainer's unmerged forward (the gap `bench/gpu/main.py` measures).
"""

from __future__ import annotations

from typing import Any

import torch


def lora_linears(model: torch.nn.Module) -> list[Any]:
    """peft's LoRA linear layers of `model`, in module order."""
    return [m for _, m in model.named_modules()
            if hasattr(m, "lora_A") and hasattr(m, "base_layer")]


def mergeable(model: torch.nn.Module) -> str | None:
    """Why the adapters of `model` cannot be merged into buffers (None when they can)."""
    for m in lora_linears(model):
        if not isinstance(m.base_layer, torch.nn.Linear):
            return f"LoRA on a {type(m.base_layer).__name__}, not a linear layer"
        if getattr(m, "fan_in_fan_out", False) or getattr(m, "lora_variant", None):
            return "a LoRA variant (DoRA, fan_in_fan_out) the merge does not handle"
    return None


class MergedWeights:
    """One adapter's merged weights, by LoRA layer; `linear(module, x)` uses them."""

    def __init__(self, model: torch.nn.Module, adapter: str):
        self.adapter = adapter
        self.layers = [m for m in lora_linears(model) if adapter in m.lora_A]
        with torch.no_grad():
            self.buffers = {id(m): m.base_layer.weight.detach().clone() for m in self.layers}
        self._versions: tuple[int, ...] | None = None
        self.refreshes = 0

    def _sources(self) -> list[torch.Tensor]:
        out = []
        for m in self.layers:
            out += [m.base_layer.weight, m.lora_A[self.adapter].weight,
                    m.lora_B[self.adapter].weight]
        return out

    def stale(self) -> bool:
        return self._versions != tuple(t._version for t in self._sources())

    def refresh(self, force: bool = False) -> bool:
        """Rewrite the buffers in place if an adapter (or base) weight changed; True if so."""
        if not (force or self.stale()):
            return False
        with torch.no_grad():
            for m in self.layers:
                a = m.lora_A[self.adapter].weight.float()
                b = m.lora_B[self.adapter].weight.float()
                w = m.base_layer.weight.float() + (b @ a) * m.scaling[self.adapter]
                self.buffers[id(m)].copy_(w)
        self._versions = tuple(t._version for t in self._sources())
        self.refreshes += 1
        return True

    def linear(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(id(module))
        if buf is None:
            return module(x)
        return torch.nn.functional.linear(x, buf, module.base_layer.bias)

"""What the sampler and training tests share: an adapter whose LoRA B is off zero (so the
adapter changes the logits), and the model's arguments every sample_batch / StaticSampler
call takes."""

from __future__ import annotations

import torch

from retrain.backends.local.backend import LocalBackend


def lora_b_off_zero(backend: LocalBackend, seed: int, scale: float = 0.1) -> LocalBackend:
    """`backend` with every LoRA B drawn from N(0, scale^2) (peft starts B at zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in backend.params.items():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return backend


def model_kw(backend: LocalBackend) -> dict:
    """EOS, pad, the cache maker and keyword of `backend`'s model."""
    m = backend.model
    return {"eos_ids": m.eos_ids, "pad_id": m.pad_id, "make_cache": backend._make_cache,
            "cache_key": m.cache_key}

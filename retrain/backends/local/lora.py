"""LoRA adapters of the local backend: their peft config, a deterministic initialisation,
which parameters belong to which adapter, and a clear error for target modules a model lacks."""

from __future__ import annotations

from typing import Any

import torch

from retrain.config.sections import ALL_LINEAR
from retrain.errors import UserError


def lora_config(rank: int, alpha: float, dropout: float, target_modules: list[str] | None) -> Any:
    """peft's LoraConfig for a causal LM (empty targets = peft's per-architecture default,
    e.g. q_proj/v_proj for Llama-like models; ["all-linear"] = every linear layer of the
    decoder, whatever the architecture names them)."""
    from peft import LoraConfig

    targets: str | list[str] | None = list(target_modules) if target_modules else None
    if targets == [ALL_LINEAR]:
        targets = ALL_LINEAR
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                      task_type="CAUSAL_LM")


def adapter_of(param_name: str) -> str | None:
    """'...q_proj.lora_A.<adapter>.weight' -> '<adapter>' (None for base parameters)."""
    parts = param_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.startswith("lora_"):
            return parts[i + 1]
    return None


def init_lora(params: dict[str, torch.nn.Parameter], seed: int) -> None:
    """peft's init (A ~ kaiming-uniform, B = 0) drawn from a private CPU generator: the same
    adapter for the same seed on any device, without touching the global RNG."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in params.items():
            if ".lora_A." in name:
                bound = 1.0 / (p.shape[1] ** 0.5)
                values = torch.empty(p.shape, dtype=torch.float32).uniform_(-bound, bound,
                                                                           generator=gen)
                p.copy_(values.to(p.device, p.dtype))
            elif ".lora_B." in name:
                p.zero_()


def check_target_modules(base: torch.nn.Module, targets: list[str], model_name: str) -> None:
    """model.lora_target_modules must name modules the model has (peft matches a name on
    the last parts of a module path): a clear config error, not a traceback from peft."""
    if ALL_LINEAR in targets and len(targets) > 1:
        raise UserError(f"model.lora_target_modules: {ALL_LINEAR!r} already names every "
                        f"linear layer; give it alone (lora_target_modules = [{ALL_LINEAR!r}]) "
                        "or list module names without it")
    names = [n for n, _ in base.named_modules() if n]
    missing = [t for t in targets if t != ALL_LINEAR
               and not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, mod in base.named_modules()
                         if isinstance(mod, torch.nn.Linear)})
        raise UserError(f"model.lora_target_modules: {', '.join(map(repr, missing))} "
                        f"{'is' if len(missing) == 1 else 'are'} not a module of {model_name}; "
                        f"its linear layers are {', '.join(linear)} (or leave the list "
                        "empty for the architecture's default)")

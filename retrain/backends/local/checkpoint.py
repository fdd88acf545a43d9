"""A local backend's resume point on disk: its weights plus optimizer and RNG state.

A LoRA run's `<checkpoint_dir>/<name>/` holds `adapter_model.safetensors` and
`adapter_config.json` (loadable by peft on its own), `optimizer.pt` and `rng.pt`; a full
fine-tuning run's holds the whole model instead (full). It is written to a temporary
folder, synced, then renamed into place, so a crash never leaves a half-written checkpoint
under its name.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from retrain.backends.base import BackendError, DivergedError

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def save_state(folder: Path, model: Any, adapter: str, optimizer: torch.optim.Optimizer,
               generator: torch.Generator) -> str:
    """Write adapter `adapter` of `model` (a LocalModel), `optimizer` and `generator` to
    `folder`, replacing what was there; returns the folder as a string."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    def write_adapter(tmp: Path) -> None:
        weights = get_peft_model_state_dict(model.peft, adapter_name=adapter)
        weights = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
        save_file(weights, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        model.lora_configs[adapter].save_pretrained(str(tmp))
        _patch_base_path(tmp, model.name_or_path)

    return write(folder, model, model.adapter_params(adapter).values(), write_adapter,
                 optimizer, generator, what="adapter")


def write(folder: Path, model: Any, params: Any, write_weights: Callable[[Path], None],
          optimizer: torch.optim.Optimizer, generator: torch.Generator, what: str) -> str:
    """A checkpoint folder: `write_weights(tmp)`, then the optimizer and RNG, synced and
    renamed into place. Refused when `params` (the trained weights) are not finite."""
    tmp = folder.parent / f".{folder.name}.tmp"
    with model.lock:  # the weights checked are the weights written
        if not all_finite(params):
            raise DivergedError(f"refusing to save checkpoint {folder.name}: the {what} "
                                "weights are not finite (the training diverged)")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write_weights(tmp)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save({"generator": generator.get_state()}, tmp / "rng.pt")
    _fsync_dir_files(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return str(folder)


def load_state(ref: str, checkpoint_dir: Path | None, model: Any, adapter: str,
               optimizer: torch.optim.Optimizer, generator: torch.Generator) -> None:
    """Restore what `save_state` wrote at `ref` (or under `checkpoint_dir` when the run folder
    was moved); a missing or damaged one is a BackendError (the trainer then falls back)."""
    from peft import set_peft_model_state_dict

    def load_adapter(path: Path) -> None:
        weights = finite_weights(path / ADAPTER_WEIGHTS, model.device)
        result = set_peft_model_state_dict(model.peft, weights, adapter_name=adapter)
        missing = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
        if missing:
            raise BackendError(f"checkpoint {path} does not match the adapter: {missing[:3]}")

    read(ref, checkpoint_dir, ADAPTER_WEIGHTS, model, load_adapter, optimizer, generator)


def read(ref: str, checkpoint_dir: Path | None, weights_file: str, model: Any,
         load_weights: Callable[[Path], None], optimizer: torch.optim.Optimizer,
         generator: torch.Generator) -> None:
    """Find the checkpoint folder `ref` (by name under `checkpoint_dir` when the run folder was
    moved), `load_weights(folder)`, then the optimizer and RNG; BackendError when it is missing
    or damaged."""
    path = Path(ref)
    if not path.is_dir() and checkpoint_dir is not None:
        path = checkpoint_dir / path.name  # the run folder was moved
    if not (path / weights_file).exists():
        raise BackendError(f"no checkpoint at {ref}")
    try:
        with model.lock:
            load_weights(path)
            state = torch.load(path / "optimizer.pt", map_location=model.device,
                               weights_only=True)
            optimizer.load_state_dict(state)
            rng = torch.load(path / "rng.pt", weights_only=True)
            generator.set_state(rng["generator"])
            optimizer.zero_grad(set_to_none=True)
    except BackendError:
        raise
    except Exception as exc:  # a torn or corrupt file: safetensors, pickle, shapes
        raise BackendError(f"checkpoint {path} is damaged: {type(exc).__name__}: "
                           f"{str(exc)[:200]}") from exc


def finite_weights(file: Path, device: torch.device) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = load_file(str(file), device=str(device))
    if not all_finite(weights.values()):
        raise BackendError(f"checkpoint {file.parent} holds non-finite (NaN or infinite) "
                           "weights; it cannot be resumed from")
    return weights


def all_finite(tensors: Any) -> bool:
    """Whether every element of every tensor is a finite number."""
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _patch_base_path(folder: Path, base: str) -> None:
    """Record the base model in adapter_config.json so peft can load the folder on its own."""
    cfg_path = folder / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = base
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _fsync_dir_files(folder: Path) -> None:
    for f in folder.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())

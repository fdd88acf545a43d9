"""Backends: the contract lives in `base`; concrete backends are imported only when chosen."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from retrain.backends.base import Backend
from retrain.slots.file_slots import ApiSlots, NoSlots

if TYPE_CHECKING:
    from retrain.config.sections import BackendConfig, ModelConfig, TrainingConfig


def create_backend(model: ModelConfig, training: TrainingConfig, backend: BackendConfig,
                   slots: ApiSlots | None = None, *, keep_reference: bool = False,
                   config_dir: Path | None = None, checkpoint_dir: Path | None = None) -> Backend:
    """Build the backend named by `[backend].backend`; heavy imports happen only here.

    `config_dir` (the config file's folder) resolves a relative `model.name` path;
    `checkpoint_dir` is where a local backend writes `save_state` folders;
    `keep_reference` (the loss has a KL term): full fine-tuning keeps the base weights.
    """
    slots = slots or NoSlots()
    if backend.backend == "local" and model.finetune == "full":
        from retrain.backends.local.full import FullBackend

        return FullBackend.from_config(model, training, backend, config_dir, checkpoint_dir,
                                       keep_reference=keep_reference)
    if backend.backend == "local":
        from retrain.backends.local.backend import LocalBackend

        return LocalBackend.from_config(model, training, backend, config_dir, checkpoint_dir)
    if backend.backend == "tinker":
        from retrain.backends.tinker.backend import TinkerBackend

        return TinkerBackend.from_config(model, training, backend, slots)
    raise ValueError(f"unknown backend {backend.backend!r}")

"""Backends: the contract lives in `base`; concrete backends are imported only when chosen."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from retrain.backends.base import Backend
from retrain.slots.file_slots import ApiSlots, NoSlots

if TYPE_CHECKING:
    from retrain.config.sections import Config


def create_backend(cfg: Config, slots: ApiSlots | None = None,
                   config_dir: Path | None = None, checkpoint_dir: Path | None = None) -> Backend:
    """Build the backend named by `[backend].backend`; heavy imports happen only here.

    `config_dir` (the config file's folder) resolves a relative `model.name` path;
    `checkpoint_dir` is where a local backend writes `save_state` folders.
    """
    slots = slots or NoSlots()
    if cfg.backend.backend == "local" and cfg.model.finetune == "full":
        from retrain.backends.local.full import FullBackend

        return FullBackend.from_config(cfg.model, cfg.training, cfg.backend, config_dir,
                                       checkpoint_dir, keep_reference=cfg.algorithm.kl_coef > 0)
    if cfg.backend.backend == "local":
        from retrain.backends.local.backend import LocalBackend

        return LocalBackend.from_config(cfg.model, cfg.training, cfg.backend, config_dir,
                                        checkpoint_dir)
    if cfg.backend.backend == "tinker":
        from retrain.backends.tinker.backend import TinkerBackend

        return TinkerBackend.from_config(cfg.model, cfg.training, cfg.backend, slots)
    raise ValueError(f"unknown backend {cfg.backend.backend!r}")

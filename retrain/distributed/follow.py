"""A run's ranks: rank 0 runs the run with a LeadBackend; every other rank builds the same
local backend and serves rank 0's messages until the run closes. No rank but 0 reads or
writes the run folder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from retrain.config.shard_choice import sharded
from retrain.distributed.channel import close, serve
from retrain.distributed.group import join, leave
from retrain.distributed.ranks import RankEnv
from retrain.errors import UserError


def run_ranked(cfg: Any, config_path: Path, ranks: RankEnv,
               run: Callable[[Any], int]) -> int:
    """Join the group; rank 0: `run(group)` (the single run, given the group), then close
    the run for every rank; the other ranks: serve until then."""
    check_world(cfg, ranks.world)
    shard = sharded(cfg.distributed.shard, cfg.model.finetune, ranks.world)
    group = join(ranks, cfg.distributed.timeout_s, cuda=_on_cuda(cfg.model.device))
    group.shard = shard
    try:
        if group.leader:
            try:
                return run(group)
            finally:
                close(group)
        return _follow(cfg, config_path, group)
    finally:
        leave(group)


def check_world(cfg: Any, world: int) -> None:
    """What the group's size rules out (under a user's torchrun the size is the launcher's,
    not [distributed]'s)."""
    if cfg.backend.backend != "local":
        raise UserError(f"{world} ranks with backend = {cfg.backend.backend!r}: a "
                        f"{cfg.backend.backend} run is one process (its devices are the "
                        "service's); start it without torchrun")
    if world > cfg.training.batch_size:
        raise UserError(f"{world} ranks but training.batch_size = {cfg.training.batch_size} "
                        "prompt groups per step: each rank needs a group; raise "
                        "training.batch_size or start fewer ranks")


def _follow(cfg: Any, config_path: Path, group: Any) -> int:
    from retrain.backends import create_backend
    from retrain.distributed.lead import local

    backend = local(create_backend(cfg.model, cfg.training, cfg.backend,
                                   keep_reference=cfg.algorithm.kl_coef > 0,
                                   config_dir=Path(config_path).resolve().parent), group)
    try:
        serve(backend, group)
    finally:
        backend.close()
    return 0


def _on_cuda(device: str) -> bool:
    if device not in ("auto", "cuda") and not device.startswith("cuda"):
        return False
    import torch

    return torch.cuda.is_available()

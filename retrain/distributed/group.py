"""The process group of a run on several ranks: joined from torchrun's environment, left at
the end. On CUDA gradients go over NCCL (each rank on its LOCAL_RANK's GPU) and the messages
over a gloo group beside it; on a CPU both go over gloo."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from retrain.distributed.ranks import RankEnv
from retrain.errors import UserError
from retrain.machine.cpu import AUTO_THREADS_ENV, auto_threads


@dataclass
class Group:
    rank: int
    world: int
    local_rank: int
    gradients: Any     # the process group the gradients are reduced over
    objects: Any       # the (gloo) group messages go over
    closed: bool = False
    shard: bool = False  # full fine-tuning sharded with FSDP2 (fsdp.py)

    @property
    def leader(self) -> bool:
        return self.rank == 0


def join(ranks: RankEnv, timeout_s: float, cuda: bool) -> Group:
    """Join the group torchrun started (env:// rendezvous); `cuda`: the model runs on GPUs."""
    import torch
    import torch.distributed as dist

    # The automatic CPU threads: the node's cores shared by its ranks (a campaign sets each
    # rank's share itself).
    os.environ.setdefault(AUTO_THREADS_ENV,
                          str(max(1, auto_threads() // max(1, ranks.local_world))))
    timeout = timedelta(seconds=timeout_s)
    if cuda:
        if ranks.local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {ranks.local_rank} but {torch.cuda.device_count()} "
                            "visible GPUs: start at most one rank per GPU on each node "
                            "(--nproc-per-node), or check CUDA_VISIBLE_DEVICES")
        torch.cuda.set_device(ranks.local_rank)
        dist.init_process_group("nccl", timeout=timeout)
        objects = dist.new_group(backend="gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
        objects = dist.group.WORLD
    return Group(ranks.rank, ranks.world, ranks.local_rank, dist.group.WORLD, objects)


def leave(group: Group) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()

"""[distributed]: one run on several devices (docs/distributed.md). Its ranks split each step's
prompt groups between them, whole groups in contiguous blocks, and all-reduce the gradients;
the result does not depend on their number, so the section may change on a resume.

Pure, but for `visible_gpus`, the loader's one look at the machine (torch is imported only
for a cuda device). `cfg` below is the run's Config (not imported: sections imports this).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from retrain.config.schema import MAX_THREADS, ConfigIssue, opt
from retrain.config.shard_choice import shard_field, shard_issues

AUTO = "auto"
MAX_TIMEOUT_S = 86_400.0  # a collective that waits a day is a hung rank


@dataclass
class DistributedConfig:
    nproc_per_node: int | str = opt(
        1, "ranks (processes) this run starts on each node, each with whole prompt groups of "
        "every step; auto = every visible GPU on cuda, 1 on a CPU; under torchrun its "
        "WORLD_SIZE rules", lo=1, hi=MAX_THREADS, words=(AUTO,))
    timeout_s: float = opt(600.0, "how long a rank waits in a collective (all-reduce, "
                           "broadcast) before the run stops with an error", lo=1,
                           hi=MAX_TIMEOUT_S)
    shard: str = shard_field()


def ranks(distributed: DistributedConfig, visible_gpus: int = 0) -> int:
    """Processes per node: the number set, or for "auto" the visible CUDA devices (pass 0
    on a CPU or MPS device: one rank)."""
    if distributed.nproc_per_node == AUTO:
        return max(1, visible_gpus)
    return int(distributed.nproc_per_node)


def several(distributed: DistributedConfig) -> bool:
    """Whether the run may have more than one rank ("auto" may)."""
    return distributed.nproc_per_node == AUTO or int(distributed.nproc_per_node) > 1


def groups_per_rank(batch_size: int, world: int) -> list[int]:
    """How many prompt groups each rank takes: rank r the contiguous block
    [r * B // W, (r + 1) * B // W)."""
    return [(r + 1) * batch_size // world - r * batch_size // world for r in range(world)]


def distributed_issues(cfg) -> list[ConfigIssue]:
    """Settings several ranks cannot run with."""
    d, t = cfg.distributed, cfg.training
    sharding = shard_issues(d.shard, cfg.model.finetune)  # LoRA refused at one rank too
    if not several(d):
        return sharding
    n = d.nproc_per_node
    shown = f"= {n!r}" if n == AUTO else f"= {n}"
    if cfg.backend.backend == "tinker":
        return [ConfigIssue("distributed.nproc_per_node", f"{shown} needs backend = 'local': "
                            "Tinker samples and trains on its own servers; set "
                            "nproc_per_node = 1")]
    issues = list(sharding)
    if t.max_steps_off_policy:
        issues.append(ConfigIssue("training.max_steps_off_policy", "is not supported with "
                                  f"several ranks (distributed.nproc_per_node {shown}); set "
                                  "it to 0"))
    if n != AUTO and n > t.batch_size:
        issues.append(ConfigIssue("distributed.nproc_per_node", f"({n}) is more than "
                                  f"training.batch_size ({t.batch_size}): each rank takes "
                                  "whole prompt groups; lower nproc_per_node or raise "
                                  "batch_size"))
    bp = cfg.backpressure
    if n != AUTO and bp.enabled and n > bp.min_batch_size:
        issues.append(ConfigIssue("backpressure.min_batch_size", f"({bp.min_batch_size}) is "
                                  f"less than distributed.nproc_per_node ({n}): the "
                                  "controller could leave a rank without a prompt group; "
                                  f"raise min_batch_size to {n}"))
    return issues


def gpu_issues(distributed: DistributedConfig, visible: int | None) -> list[ConfigIssue]:
    """More ranks asked than the `visible` CUDA devices (None: not a CUDA device)."""
    n = distributed.nproc_per_node
    if visible is None or n == AUTO or n <= max(1, visible):
        return []
    return [ConfigIssue("distributed.nproc_per_node", f"({n}) asks for {n} GPUs, {visible} "
                        "visible on this machine (CUDA_VISIBLE_DEVICES); lower nproc_per_node "
                        f"to {max(1, visible)} or use \"auto\"")]


def visible_gpus(device: str) -> int | None:
    """The CUDA devices a run on `device` would see, or None when it would not run on CUDA
    (auto without an NVIDIA driver, or without torch). Imports torch only for cuda."""
    if device not in ("cuda", AUTO) or (device == AUTO and
                                        not Path("/proc/driver/nvidia").exists()):
        return None
    try:
        import torch
    except ImportError:
        return None
    count = torch.cuda.device_count()
    return None if device == AUTO and count == 0 else count

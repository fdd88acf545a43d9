"""The `retrain explain` line of a run on several ranks ([distributed]): how many, the prompt
groups each takes of a step (contiguous blocks of whole groups), and what the all-reduce moves
each step: every trainable parameter's gradient in float32, once per update.
"""

from __future__ import annotations

from pathlib import Path

from retrain.cli.explain.memory import size_text, trainable_count
from retrain.config.distributed_section import AUTO, groups_per_rank, ranks, several, visible_gpus
from retrain.config.sections import Config

GRADIENT_BYTES = 4  # gradients are reduced in float32, whatever the weights' dtype


def allreduce_bytes(trainable: int, updates: int) -> int:
    """Bytes each rank all-reduces per step: one float32 gradient per trainable parameter,
    once per optimizer update (training.mini_batches x training.epochs)."""
    return trainable * GRADIENT_BYTES * updates


def groups_text(batch_size: int, world: int) -> str:
    """Prompt groups per rank: "2", or "2-3" when batch_size does not divide evenly."""
    counts = groups_per_rank(batch_size, world)
    low, high = min(counts), max(counts)
    return f"{low}" if low == high else f"{low}-{high}"


def distributed_line(cfg: Config, config_dir: Path) -> str | None:
    """None for one rank (the default)."""
    d, t = cfg.distributed, cfg.training
    if not several(d):
        return None
    visible = visible_gpus(cfg.model.device) if d.nproc_per_node == AUTO else None
    world = ranks(d, visible or 0)
    how = " (auto: the visible GPUs)" if d.nproc_per_node == AUTO else ""
    if world == 1:
        return ("1 rank (nproc_per_node = \"auto\": " +
                ("one visible GPU)" if visible else "no CUDA device here)"))
    updates = t.mini_batches * t.epochs
    trainable = trainable_count(cfg, config_dir)
    reduce = (f"all-reduce ~{size_text(allreduce_bytes(trainable, updates))} per step "
              f"({trainable:,} trainable parameters x {GRADIENT_BYTES} bytes x {updates} "
              f"update{'s' if updates > 1 else ''})" if trainable is not None else
              f"all-reduce size unknown until {cfg.model.name} is on this machine")
    groups = groups_text(t.batch_size, world)
    return (f"{world} ranks per node{how}, {groups} prompt group{'' if groups == '1' else 's'} "
            f"each of {t.batch_size} per step; {reduce}; collective timeout {d.timeout_s:g}s")

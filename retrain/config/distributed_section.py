"""[distributed]: one run on several devices (docs/distributed.md). On this branch only its
`shard` key (shard_choice.py); `nproc_per_node` and `timeout_s` come with the section's own
branch. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from retrain.config.schema import ConfigIssue
from retrain.config.shard_choice import shard_field, shard_issues


@dataclass
class DistributedConfig:
    shard: str = shard_field()


def distributed_issues(cfg) -> list[ConfigIssue]:
    """Settings several ranks cannot run with."""
    return shard_issues(cfg.distributed.shard, cfg.model.finetune)

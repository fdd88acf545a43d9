"""`[distributed] shard`: whether full fine-tuning shards its training state over the ranks
(FSDP2, retrain/distributed/fsdp.py) or every rank holds all of it. Pure: no torch.

- "none": every rank holds the whole model, its gradients and AdamW states (data-parallel).
- "fsdp": weights, gradients and AdamW states in 1/N per rank (plus the whole weights once,
  to sample from); full fine-tuning only: a LoRA adapter is small and stays replicated.
- "auto": "fsdp" for full fine-tuning on more than one rank, else "none".
"""

from __future__ import annotations

from retrain.config.schema import ConfigIssue, opt
from retrain.errors import UserError

SHARDS = ("none", "fsdp", "auto")


def shard_field() -> str:
    """The `shard` key of [distributed]."""
    return opt("none", "full fine-tuning on several ranks: fsdp = weights, gradients and "
               "AdamW states sharded over the ranks (FSDP2; each also holds the whole weights "
               "to sample from); none = every rank holds all of it; auto = fsdp for "
               "model.finetune = 'full' on more than one rank", choices=SHARDS)


def shard_issues(shard: str, finetune: str) -> list[ConfigIssue]:
    """What `shard` cannot run with: fsdp with a LoRA adapter."""
    if shard == "fsdp" and finetune != "full":
        return [ConfigIssue("distributed.shard", f"= 'fsdp' shards full fine-tuning, but "
                            f"model.finetune = {finetune!r}: a LoRA adapter stays replicated "
                            "on every rank; set distributed.shard = 'none' (or 'auto'), or "
                            "model.finetune = 'full'")]
    return []


def sharded(shard: str, finetune: str, world: int) -> bool:
    """Whether a run of `world` ranks shards its training; "fsdp" with LoRA is a UserError."""
    issues = shard_issues(shard, finetune)
    if issues:
        raise UserError(issues[0].render("config"))
    if world < 2:
        return False
    return shard == "fsdp" or (shard == "auto" and finetune == "full")

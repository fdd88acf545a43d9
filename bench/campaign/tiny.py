"""The tiny-model campaign that bench/campaign/ray_run.py times and the campaign tests run:
`tiny-random` on the CPU, 2 prompts x 2 completions of 8 tokens a step, seeds in parallel."""

from __future__ import annotations

from pathlib import Path


def tiny_campaign_toml(log_dir: Path | str, seeds: list[int] | str, *, max_steps: int,
                       max_workers: int, stagger_s: float = 0.0, training: str = "",
                       campaign: str = "", tables: str = "") -> str:
    """The TOML text. `training` and `campaign` are lines added to those tables; `tables`,
    whole tables added at the end (a reward, conditions)."""
    return f"""
[model]
name = "tiny-random"
dtype = "float32"
threads = 1
[data]
eval_size = 0
[training]
batch_size = 2
group_size = 2
max_tokens = 8
max_steps = {max_steps}
{training}
[logging]
log_dir = "{log_dir}"
[campaign]
seeds = {seeds}
parallel = true
max_workers = {max_workers}
stagger_seconds = {stagger_s}
{campaign}
{tables}"""

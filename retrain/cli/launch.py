"""`retrain FILE.toml`: load the config, then run it as a single run or as a campaign."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from retrain.config.loader import load
from retrain.config.paths import anchor_paths


def launch(path: Path, overrides: dict[str, Any], *, new: bool = False, force: bool = False) -> int:
    """Run the config at `path`; returns the process exit status."""
    cfg, plan = load(path, overrides)
    cfg = anchor_paths(cfg, Path(path).resolve().parent)
    if plan is not None:
        from functools import partial

        from retrain.campaign.runner import run_campaign
        from retrain.cli.explain.cost import PromptTokens, run_bound

        counter = PromptTokens(Path(path).resolve().parent)  # one tokenizer for every run
        return run_campaign(cfg, plan, Path(path), new=new, force=force,
                            bound_of=partial(run_bound, counter=counter))
    from retrain.run.single import run_single

    return run_single(cfg, Path(path), new=new)

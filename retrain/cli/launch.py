"""`retrain FILE.toml`: load the config, then run it as a single run or as a campaign; a
run on several ranks starts them (the elastic launcher), or is one of them (torchrun's
environment)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from retrain.config.loader import load
from retrain.config.paths import anchor_paths
from retrain.errors import UserError


def launch(path: Path, overrides: dict[str, Any], *, new: bool = False, force: bool = False) -> int:
    """Run the config at `path`; returns the process exit status."""
    from retrain.distributed.ranks import rank_env

    cfg, plan = load(path, overrides)
    cfg = anchor_paths(cfg, Path(path).resolve().parent)
    ranks = rank_env(os.environ)  # under torchrun: this process is one rank of the run
    if plan is not None:
        if ranks is not None:
            raise UserError(f"{path}: a campaign runs under torchrun; start the campaign "
                            "without it (each run starts its own ranks from [distributed])")
        from functools import partial

        from retrain.campaign.runner import run_campaign
        from retrain.cli.explain.cost import PromptTokens, run_bound

        counter = PromptTokens(Path(path).resolve().parent)  # one tokenizer for every run
        return run_campaign(cfg, plan, Path(path), new=new, force=force,
                            bound_of=partial(run_bound, counter=counter))
    from retrain.run.single import run_single

    if ranks is not None:
        from retrain.distributed.follow import run_ranked

        return run_ranked(cfg, Path(path), ranks,
                          lambda group: run_single(cfg, Path(path), new=new, group=group))
    nproc = _per_node(cfg)
    if nproc > 1:
        from retrain.distributed.launch import start_ranks

        return start_ranks(nproc, sys.argv[1:])
    return run_single(cfg, Path(path), new=new)


def _per_node(cfg: Any) -> int:
    """[distributed] nproc_per_node, "auto" resolved (every visible GPU; 1 on a CPU)."""
    if not hasattr(getattr(cfg, "distributed", None), "nproc_per_node"):  # TEMP: the section
        return 1
    from retrain.config.distributed_section import processes_per_node

    return processes_per_node(cfg.distributed, cfg.model.device)

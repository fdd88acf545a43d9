"""`retrain FILE.toml`: load the config, then run it as a single run or as a campaign."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from retrain.config import load_config
from retrain.config_paths import anchor_paths


def launch(path: Path, overrides: dict[str, Any], *, new: bool = False, force: bool = False) -> int:
    """Run the config at `path`; returns the process exit status."""
    cfg = anchor_paths(load_config(path, overrides), Path(path).resolve().parent)
    if cfg.is_campaign:
        from retrain.campaign.runner import run_campaign

        return run_campaign(cfg, Path(path), new=new, force=force)
    from retrain.trainer import run_single

    return run_single(cfg, Path(path), new=new)

"""File references in a config (data file, reward module, environment factory and tools,
local model folder), anchored to
the folder of the config file that named them, so a run's resolved config finds the same files
when it is re-run from its log folder."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

from retrain.config.sections import Config, run_config


def anchor_paths(cfg: Config, config_dir: Path) -> Config:
    """Make file references relative to the config file absolute.

    The resolved config a run writes into its log folder (and each campaign run's config)
    must still find the same JSONL file, reward module, environment and local model from
    there (`retrain eval` plays a run's held-out episodes from its log folder).
    """
    changes: dict[str, Any] = {}
    if cfg.data.path and not Path(cfg.data.path).expanduser().is_absolute():
        changes["data.path"] = str(config_dir / cfg.data.path)
    function = _anchor_spec(cfg.reward.function, config_dir)
    if function != cfg.reward.function:
        changes["reward.function"] = function
    factory = _anchor_spec(cfg.environment.factory, config_dir)
    if factory != cfg.environment.factory:
        changes["environment.factory"] = factory
    tools = [_anchor_spec(t, config_dir) for t in cfg.environment.tools]
    if tools != cfg.environment.tools:
        changes["environment.tools"] = tools
    local_model = config_dir / cfg.model.name
    if not Path(cfg.model.name).is_absolute() and local_model.is_dir():
        changes["model.name"] = str(local_model)
    return run_config(cfg, **changes) if changes else cfg


def _anchor_spec(spec: str, config_dir: Path) -> str:
    """A 'file.py:name' or 'module:name' reference, its file made absolute where it is one."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target:
        return spec
    if target.endswith(".py") or "/" in target:
        path = Path(target).expanduser()
        return spec if path.is_absolute() else f"{config_dir / path}:{name}"
    module_file = config_dir / (target.replace(".", "/") + ".py")
    if "." not in target and module_file.is_file():
        return f"{module_file}:{name}"  # a module beside the config file
    return spec  # an installed module (or a package beside the config, found via config_dir)


def special_file(path: Path) -> str | None:
    """What `path` is when it exists but is neither a regular file nor a folder ("a named
    pipe", ...): reading it may block or never end. None otherwise."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    kinds = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), None)

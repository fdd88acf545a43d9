"""Campaign matrix: conditions x grid x seeds -> run specs with stable, folder-safe names.

Pure: no I/O. Names are `<condition>_s<seed>`, where the condition label folds in the grid
values (`rloo_lr-2e-05_s1`), and are safe as folder names: letters of any script kept, no
separators, no leading dots, no collisions (a name that repeats after cleaning gets `-2`,
`-3`, ... in matrix order).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrain.campaign.plan import CampaignPlan, Condition
from retrain.config import loader as config_file
from retrain.config import sections as config_mod
from retrain.config.sections import Config, ConfigError, ConfigIssue

MAX_NAME = 80          # folder-name budget for a run name, seed suffix included
BASE_CONDITION = "base"
# Keys the campaign sets for every run, so a condition may not.
RESERVED_KEYS = {
    "training.seed": "vary the seed with [campaign].seeds",
    "logging.log_dir": "runs always write inside the campaign folder",
    "logging.run_name": "run names come from the condition and seed",
    "backend.max_concurrent": "the API cap is campaign-wide; set it in [backend]",
    "backend.max_concurrent_min": "the API cap is campaign-wide; set it in [backend]",
    "backend.max_concurrent_max": "the API cap is campaign-wide; set it in [backend]",
}
_UNSAFE = re.compile(r"[^\w.+=-]+")  # \w: letters and digits of every script, and _


@dataclass
class RunSpec:
    """One run of the campaign: its folder name, condition label, seed and dotted overrides."""

    name: str
    condition: str
    seed: int
    overrides: dict[str, Any] = field(default_factory=dict)


def expand(cfg: Config, camp: CampaignPlan) -> list[RunSpec]:
    """Every run of the campaign `camp` over the base run `cfg`, in matrix order (condition,
    then grid cell, then seed)."""
    _check_reserved(camp)
    seeds = list(camp.seeds) or [cfg.training.seed]
    cells = _cells(camp)
    labels = _unique([label for label, _ in cells])
    specs = []
    for label, (_, overrides) in zip(labels, cells, strict=True):
        for seed in seeds:
            specs.append(RunSpec(name=f"{label}_s{seed}", condition=label, seed=seed,
                                 overrides=copy.deepcopy(overrides)))
    return specs


def run_config_for(cfg: Config, spec: RunSpec, campaign_dir: str | Path) -> Config:
    """The resolved single-run config of `spec`: a plain run that writes into the campaign."""
    changes = dict(spec.overrides)
    changes["training.seed"] = spec.seed
    changes["logging.log_dir"] = str(campaign_dir)
    changes["logging.run_name"] = spec.name
    raw = merge_overrides(config_mod.to_dict(cfg), changes)
    return config_mod.from_dict(raw, f"<run {spec.name}>")


def merge_overrides(raw: dict, overrides: dict[str, Any]) -> dict:
    """A copy of a TOML-shaped dict with dotted overrides applied; tables merge into tables.

    `backend.options.foo = {a = 1}` in a condition parses as `"backend.options" = {foo = {a = 1}}`;
    replacing the whole table would drop the base config's other options, so tables merge.
    Keys inside table values are used as is (a free-form key may itself contain dots).
    """
    out = copy.deepcopy(raw)
    for dotted, value in overrides.items():
        *parents, last = dotted.split(".")
        node = out
        for p in parents:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        _merge_into(node, last, value)
    return out


def _merge_into(node: dict, key: str, value: Any) -> None:
    if isinstance(value, dict) and value and isinstance(node.get(key), dict):
        for k, v in value.items():
            _merge_into(node[key], k, v)
    else:
        node[key] = copy.deepcopy(value)


def matrix_hash(run_configs: dict[str, Config]) -> str:
    """Hash of every run's name and resolved config, independent of the campaign's location."""
    h = hashlib.sha256()
    for name, run in run_configs.items():
        placed = copy.deepcopy(run)
        placed.logging.log_dir = ""
        h.update(name.encode() + b"\0" + config_file.dumps_config(placed).encode() + b"\0")
    return h.hexdigest()[:16]


def safe_name(text: str, fallback: str = "run") -> str:
    """A readable folder name: letters (of any script) and digits kept, unsafe characters
    become '-', no leading dots, bounded length."""
    cleaned = _UNSAFE.sub("-", unicodedata.normalize("NFC", text)).strip("-._+=")
    cleaned = re.sub(r"-{2,}", "-", cleaned)
    if not cleaned:
        return fallback
    if len(cleaned) > MAX_NAME - 12:
        digest = hashlib.sha256(text.encode()).hexdigest()[:6]
        cleaned = cleaned[: MAX_NAME - 19].rstrip("-._+=") + "-" + digest
    return cleaned


def value_label(value: Any) -> str:
    """A short readable rendering of an override value for run names."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (int, str)):
        return str(value)
    if isinstance(value, list) and all(isinstance(v, (int, float, str, bool)) for v in value):
        return "+".join(value_label(v) for v in value) or "empty"
    return "h" + hashlib.sha256(repr(value).encode()).hexdigest()[:6]


def _check_reserved(camp: CampaignPlan) -> None:
    issues = []
    for i, cond in enumerate(camp.conditions):
        issues += [ConfigIssue(f"campaign.conditions[{i}].\"{k}\"", f"cannot be set per run: {why}")
                   for k, why in RESERVED_KEYS.items() if k in cond.overrides]
    issues += [ConfigIssue(f"campaign.grid.\"{k}\"", f"cannot be varied: {why}")
               for k, why in RESERVED_KEYS.items() if k in camp.grid]
    for i, cond in enumerate(camp.conditions):
        issues += [ConfigIssue(f"campaign.conditions[{i}].\"{k}\"",
                               "is also in [campaign.grid]; set it in one place only")
                   for k in cond.overrides if k in camp.grid]
    if issues:
        raise ConfigError("[campaign]", issues)


def _cells(camp: CampaignPlan) -> list[tuple[str, dict[str, Any]]]:
    """(label, overrides) per condition x grid cell, before de-duplicating labels."""
    conditions = camp.conditions or [Condition()]
    grid_keys = list(camp.grid)
    combos = list(itertools.product(*(camp.grid[k] for k in grid_keys)))
    out = []
    for cond in conditions:
        cond_label = _condition_label(cond) if (camp.conditions or not grid_keys) else ""
        for combo in combos:
            overrides = {**cond.overrides, **dict(zip(grid_keys, combo, strict=True))}
            grid_label = "_".join(f"{_short_key(k)}-{value_label(v)}"
                                  for k, v in zip(grid_keys, combo, strict=True))
            label = "_".join(p for p in (cond_label, grid_label) if p)
            out.append((safe_name(label, BASE_CONDITION), overrides))
    return out


def _condition_label(cond: Condition) -> str:
    if cond.name:
        return cond.name
    if not cond.overrides:
        return BASE_CONDITION
    return "_".join(f"{_short_key(k)}-{value_label(v)}" for k, v in cond.overrides.items())


def _short_key(dotted: str) -> str:
    return dotted.rsplit(".", 1)[-1]


def _unique(labels: list[str]) -> list[str]:
    """Make labels unique in order: the second 'x' becomes 'x-2' (never an existing label)."""
    taken = set()
    out = []
    for label in labels:
        candidate, n = label, 1
        while candidate.lower() in taken:
            n += 1
            candidate = f"{label}-{n}"
        taken.add(candidate.lower())
        out.append(candidate)
    return out

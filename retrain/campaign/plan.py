"""The campaign plan: the [campaign] table of a config file, parsed and checked on its own.

A file is a run config plus, optionally, this plan (`config_file` splits the two), so the
single run's `Config` knows nothing about campaigns. The plan says which runs to make
(conditions x grid x seeds, expanded by `matrix`) and how to schedule them (`runner`).
Pure: no torch, no SDK, no I/O.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from retrain.campaign import race_plan, ray_address
from retrain.config import toml_io
from retrain.config.schema import (
    MAX_WAIT_S,
    MAX_WORKERS,
    ConfigIssue,
    check_field,
    did_you_mean,
    fields_of,
    flatten,
    hints_of,
    key_hint,
    opt,
    set_field,
    show,
    unknown_key,
)
from retrain.config.sections import SECTIONS, Config

SECTION = "campaign"


@dataclass
class Condition:
    """One campaign condition: a name and dotted-key overrides of any config key."""

    name: str = ""
    overrides: dict = field(default_factory=dict)


@dataclass
class CampaignPlan:
    """The [campaign] table: which runs a file expands into, and how they are scheduled."""

    name: str = opt("", "campaign folder name under log_dir (default: the TOML file's stem)")
    seeds: list[int] = opt([], "one run per seed per condition", factory=True)
    parallel: bool = opt(False, "run several workers at once")
    max_workers: int = opt(2, "workers alive at once when parallel, a run of N ranks "
                           "([distributed]) counting N (0 = all)", lo=0,
                           hi=MAX_WORKERS)
    stagger_seconds: float = opt(5.0, "minimum gap between worker launches", lo=0, hi=MAX_WAIT_S)
    max_retries: int = opt(1, "extra attempts for a failed run on re-launch", lo=0, hi=1000)
    conditions: list[Condition] = opt([], "[[campaign.conditions]]: name + dotted-key overrides",
                                      factory=True)
    grid: dict = opt({}, "[campaign.grid]: dotted key -> list of values (cartesian product)",
                     factory=True)
    executor: str = opt("local", "where runs execute: local processes, or a Ray cluster",
                        choices=("local", "ray"))
    ray_address: str = opt("", "ray: cluster address, host:port or ray://host:port ('' = "
                           "$RAY_ADDRESS or a running cluster, else start one here)")
    run_resources: dict = opt({}, "ray: resources per run, {cpu = N, gpu = M} (default: cpu = "
                              "model.threads or 1, gpu = 1 when the model runs on cuda); "
                              "per rank with [distributed] nproc_per_node > 1", factory=True)
    race: dict = opt({}, "[campaign.race]: race the conditions seed by seed, eliminating the "
                     "ones behind beyond doubt (metric, direction, min_seeds, max_seeds, "
                     "round_seeds, confidence, margin, budget_runs, threshold; "
                     "docs/campaigns.md#racing)", factory=True)
    budget_usd: float = opt(0.0, "start no run whose estimate would take the campaign's cost "
                            "([cost]) past this many US dollars; a run stops where it "
                            "crosses (0 = none)", lo=0)
    budget_tokens: int = opt(0, "the same for prefill + sampled + trained tokens (0 = none)",
                             lo=0)

    @property
    def is_campaign(self) -> bool:
        """A campaign expands into several runs; anything else is a single run."""
        return bool(self.conditions or self.grid or self.seeds)


# Every section a config file may hold, in file order ([campaign] before [logging], as in
# config.toml and the generated docs): what did-you-mean hints and dotted keys range over.
FILE_SECTIONS: dict[str, type] = {
    **{k: v for k, v in SECTIONS.items() if k != "logging"},
    SECTION: CampaignPlan,
    "logging": SECTIONS["logging"],
}
RUN_RESOURCE_KEYS = ("cpu", "gpu")


def check_value(key: str, value: Any) -> tuple[Any, str | None]:
    """Coerce `value` to the [campaign] key's type and check its range: (value, problem)."""
    value, bad = check_field(CampaignPlan, key, value)
    if bad is None and key == "ray_address":
        bad = ray_address.problem(value)
    return value, bad


# ---------------------------------------------------------------------------- parsing


def set_keys(plan: CampaignPlan, body: dict, issues: list[ConfigIssue]) -> None:
    """Check and store every key of a [campaign] table on `plan`, recording each problem."""
    fields = fields_of(CampaignPlan)
    for key, value in body.items():
        if key not in fields:
            issues.append(unknown_key(FILE_SECTIONS, SECTION, key))
        elif key == "conditions":
            plan.conditions = _conditions(value, issues)
        elif key == "grid":
            plan.grid = _grid(value, issues)
        elif key == "race":
            plan.race = race_plan.parse(value, issues)
        elif key == "ray_address" and (bad := check_value(key, value)[1]):
            issues.append(ConfigIssue(f"{SECTION}.{key}", bad))
        else:
            set_field(plan, SECTION, key, value, issues)


def _conditions(value: Any, issues: list[ConfigIssue]) -> list[Condition]:
    if not isinstance(value, list) or not all(isinstance(c, dict) for c in value):
        issues.append(ConfigIssue("campaign.conditions", "must be an array of tables "
                                  "([[campaign.conditions]]), got " + show(value)))
        return []
    out = []
    for i, table in enumerate(value):
        name = table.get("name", "")
        where = f"campaign.conditions[{i}]"
        if not isinstance(name, str):
            issues.append(ConfigIssue(f"{where}.name", f"expected a string, got {show(name)}"))
            name = ""
        elif "name" in table and not any(ch.isalnum() for ch in name):
            issues.append(ConfigIssue(f"{where}.name", f"{show(name)} holds no letter or digit "
                                      "to name the runs' folders; give the condition a name, "
                                      "or leave name out to have one made from its overrides"))
        overrides = flatten({k: v for k, v in table.items() if k != "name"}, FILE_SECTIONS)
        for key, val in overrides.items():
            problem = check_override(key, val)
            if problem:
                issues.append(ConfigIssue(f"{where}.\"{key}\"", problem))
        out.append(Condition(name=name, overrides=overrides))
    return out


def _grid(value: Any, issues: list[ConfigIssue]) -> dict:
    if not isinstance(value, dict):
        issues.append(ConfigIssue("campaign.grid", f"must be a table, got {show(value)}"))
        return {}
    grid = flatten(value, FILE_SECTIONS)
    for key, vals in grid.items():
        if not isinstance(vals, list) or not vals:
            issues.append(ConfigIssue(f"campaign.grid.\"{key}\"",
                                      f"expected a non-empty list of values, got {show(vals)}"))
            continue
        for v in vals:
            problem = check_override(key, v)
            if problem:
                issues.append(ConfigIssue(f"campaign.grid.\"{key}\"", problem))
                break
    return grid



def split_key(dotted: str) -> tuple[str, str, list[str]] | str:
    """'backend.options.a.b' -> ('backend', 'options', ['a', 'b']); a message if it is no key
    a run may override."""
    parts = dotted.split(".")
    if len(parts) < 2 or not all(parts):
        return f"'{dotted}' is not a 'section.key' name"
    section, key, rest = parts[0], parts[1], parts[2:]
    if section not in FILE_SECTIONS:
        return f"unknown section '{section}'{did_you_mean(section, FILE_SECTIONS)}"
    cls = FILE_SECTIONS[section]
    if key not in fields_of(cls):
        return f"unknown key '{section}.{key}'{key_hint(FILE_SECTIONS, section, key)}"
    if rest and hints_of(cls)[key] is not dict:
        return f"'{section}.{key}' is not a table, so '{dotted}' names nothing"
    if section == SECTION:
        return "campaign keys cannot be overridden per run"
    return section, key, rest


def check_override(dotted: str, value: Any) -> str | None:
    """The problem with overriding `dotted` by `value` in one run, or None when it is fine."""
    parsed = split_key(dotted)
    if isinstance(parsed, str):
        return parsed
    section, key, rest = parsed
    if rest:
        return None if toml_io.is_tomlable(value) else f"cannot store {value!r}"
    return check_field(SECTIONS[section], key, value)[1]


def checks(plan: CampaignPlan) -> list[ConfigIssue]:
    """Problems that involve more than one [campaign] value."""
    issues = []
    names = [c.name for c in plan.conditions if c.name]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        issues.append(ConfigIssue("campaign.conditions", "condition names must be unique; "
                                  "repeated: " + ", ".join(dupes)))
    if len(set(plan.seeds)) != len(plan.seeds):
        issues.append(ConfigIssue("campaign.seeds", "seeds must be unique, got "
                                  + show(plan.seeds)))
    if any(s < 0 for s in plan.seeds):
        issues.append(ConfigIssue("campaign.seeds", "seeds must be >= 0, got "
                                  + show(plan.seeds)))
    issues += _run_resources_issues(plan.run_resources)
    race = race_plan.race_of(plan.race)
    if race is not None:
        issues += race_plan.plan_issues(race, plan.seeds, cell_count(plan))
    return issues


def cell_count(plan: CampaignPlan) -> int:
    """How many conditions the matrix has, a grid cell counting as one."""
    cells = max(1, len(plan.conditions))
    for values in plan.grid.values():
        cells *= len(values) if isinstance(values, list) else 1
    return cells


def _run_resources_issues(value: dict) -> list[ConfigIssue]:
    issues = []
    for key, amount in value.items():
        where = f"campaign.run_resources.{key}"
        if key not in RUN_RESOURCE_KEYS:
            issues.append(ConfigIssue(where, "unknown resource; run_resources takes cpu and gpu, "
                                      "e.g. run_resources = {cpu = 2, gpu = 1}"))
        elif isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount < 0:
            issues.append(ConfigIssue(where, f"expected a number >= 0, got {show(amount)}"))
    return issues



def run_resources(cfg: Config, plan: CampaignPlan, cluster_gpus: float = 0.0) -> dict[str, float]:
    """What one run asks Ray for: [campaign] run_resources, with defaults derived from the run
    (cpu = model.threads or 1; gpu = 1 when the model runs on cuda, i.e. device = "cuda", or
    "auto" on a cluster that has GPUs; a remote backend needs none)."""
    res = plan.run_resources
    on_cuda = cfg.model.device == "cuda" or (cfg.model.device == "auto" and cluster_gpus > 0)
    gpu = 1.0 if on_cuda and cfg.backend.backend == "local" else 0.0
    return {"cpu": float(res.get("cpu", cfg.model.threads or 1)), "gpu": float(res.get("gpu", gpu))}


def to_table(plan: CampaignPlan) -> dict:
    """The plan as its TOML table (every key, defaults included; conditions as tables; no race
    table without a race: an empty [campaign.race] is a race at its defaults)."""
    body: dict[str, Any] = {}
    for name in fields_of(CampaignPlan):
        value = getattr(plan, name)
        if name == "race" and not value:
            continue
        if name == "conditions":
            value = [{"name": c.name, **c.overrides} for c in value]
        body[name] = copy.deepcopy(value)
    return body

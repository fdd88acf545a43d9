"""A config file: TOML text <-> (the run's `Config`, its `CampaignPlan` or None).

The one loader: a file is read and parsed once, its [campaign] table goes to the campaign
plan and every other section to the single run's `Config`. The run folder's config.toml is
written here too, in the same layout (every section, [campaign] at its defaults), so it
loads back as the single run it is. The only I/O is reading the named file.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from retrain.campaign import plan as plan_mod
from retrain.campaign.plan import FILE_SECTIONS, SECTION, CampaignPlan
from retrain.config import sections as config
from retrain.config import toml_io
from retrain.config.cost_section import campaign_cost_issues
from retrain.config.cross_checks import cross_checks, table_checks
from retrain.config.distributed_section import AUTO, gpu_issues, visible_gpus
from retrain.config.judge_section import JudgeConfig
from retrain.config.paths import special_file
from retrain.config.schema import flatten, section_problem
from retrain.config.sections import Config, ConfigError, ConfigIssue
from retrain.config.sft_section import SftDataConfig

# The tables inside a section, checked key by key like one: a key they leave out is its default.
TABLES = {"reward.judge": JudgeConfig, "sft.data": SftDataConfig}

# ---------------------------------------------------------------------------- parsing


def parse(raw: dict, source: str = "<config>") -> tuple[Config, CampaignPlan]:
    """Validate a TOML-shaped dict into the run config and the campaign plan (its defaults
    when the file has no [campaign]), or raise ConfigError naming every problem."""
    issues: list[ConfigIssue] = []
    cfg, plan = Config(), CampaignPlan()
    for name, body in raw.items():
        problem = section_problem(FILE_SECTIONS, name, body)
        if problem:
            issues.append(problem)
        elif name == SECTION:
            plan_mod.set_keys(plan, body, issues)
        else:
            config.set_section(cfg, name, body, issues, FILE_SECTIONS)
    issues += cross_checks(cfg) + plan_mod.checks(plan) + campaign_cost_issues(cfg.cost, plan)
    issues += table_checks(cfg, issues)
    if issues:
        raise ConfigError(source, issues)
    return cfg, plan


def read_file(path: str | Path, overrides: dict[str, Any] | None = None
              ) -> tuple[Config, CampaignPlan]:
    """Load, override and validate a config file into (run config, plan); the plan is there
    even for a single run (`explain` warns about [campaign] keys that have no effect)."""
    raw = read_toml_file(path)
    if overrides:
        raw = config.apply_overrides(raw, overrides)
    cfg, plan = parse(raw, str(path))
    issues = device_issues(cfg, plan)
    if issues:
        raise ConfigError(str(path), issues)
    return cfg, plan


def device_issues(cfg: Config, plan: CampaignPlan) -> list[ConfigIssue]:
    """More ranks than this machine's GPUs, for a file about to run or be explained here (a
    Ray campaign's runs are checked on their own nodes, by their worker's load)."""
    if cfg.distributed.nproc_per_node in (1, AUTO) or plan.is_campaign and \
            plan.executor == "ray":
        return []
    return gpu_issues(cfg.distributed, visible_gpus(cfg.model.device))


def load(path: str | Path, overrides: dict[str, Any] | None = None
         ) -> tuple[Config, CampaignPlan | None]:
    """(run config, campaign plan), the plan None when the file describes a single run."""
    cfg, plan = read_file(path, overrides)
    return cfg, plan if plan.is_campaign else None


def loads(text: str, source: str = "<string>") -> tuple[Config, CampaignPlan | None]:
    """`load` for TOML text."""
    cfg, plan = parse(parse_toml(text, source), source)
    return cfg, plan if plan.is_campaign else None


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> Config:
    """The run config of a file (a run folder's config.toml, or a campaign's base run)."""
    return read_file(path, overrides)[0]


def loads_config(text: str, source: str = "<string>") -> Config:
    """The run config of TOML text."""
    return parse(parse_toml(text, source), source)[0]


def read_toml_file(path: str | Path) -> dict:
    """Read and parse a TOML file; every failure is a one-line ConfigError."""
    p = Path(path)
    src = str(path)
    if not p.exists():
        raise ConfigError(src, [ConfigIssue("", "no such file; create one with "
                                            "`retrain init --template quickstart`")])
    if p.is_dir():
        raise ConfigError(src, [ConfigIssue("", "is a directory, not a TOML file")])
    if special_file(p):  # reading a pipe waits for a writer; a device may never end
        raise ConfigError(src, [ConfigIssue("", f"is {special_file(p)}, not a regular file; "
                                            "give the path of a TOML file")])
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(src, [ConfigIssue("", f"cannot be read: {exc.strerror}")]) from None
    return parse_toml(data, src)


def parse_toml(data: bytes | str, source: str) -> dict:
    """Parse TOML text, turning syntax errors into file:line:column messages."""
    if isinstance(data, bytes):
        if b"\x00" in data:
            raise ConfigError(source, [ConfigIssue("", "is a binary file, not TOML text")])
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(source, [ConfigIssue("", "is not UTF-8 text, so not TOML")]) from None
    if data.startswith("\ufeff"):  # Windows editors write one; TOML does not allow it
        raise ConfigError(source, [ConfigIssue("", "starts with a byte-order mark (BOM), which "
                                               "TOML does not allow; save the file as UTF-8 "
                                               "without BOM")])
    if not data.strip():
        raise ConfigError(source, [ConfigIssue("", "is empty; start from "
                                               "`retrain init --template quickstart`")])
    try:
        return toml_io.loads(data)
    except toml_io.TOMLDecodeError as exc:
        msg = str(exc)
        m = re.search(r"\(at line (\d+), column (\d+)\)", msg)
        if m:
            reason, where = msg[: m.start()].strip(), f"{m.group(1)}:{m.group(2)}"
        elif "(at end of document)" in msg:
            lines = data.rstrip().split("\n")
            reason = msg.replace("(at end of document)", "").strip() + " at the end of the file"
            where = f"{len(lines)}:{len(lines[-1]) + 1}"
        else:
            raise ConfigError(source, [ConfigIssue("", f"invalid TOML: {msg}")]) from None
        if m:
            reason, where = _name_the_key(reason, data, int(m.group(1)), int(m.group(2)))
        raise ConfigError(f"{source}:{where}",
                          [ConfigIssue("", f"invalid TOML: {reason}")]) from None


_HEADER = re.compile(r"\s*\[\[?\s*([^\]]*?)\s*\]")
_KEY = re.compile(r"\s*([^=#\[]+?)\s*=")


def _name_the_key(reason: str, text: str, line: int, col: int) -> tuple[str, str]:
    """tomllib's reason and `line:col`, with the key named where tomllib does not name it: a
    key or table set twice, a bare key with characters TOML does not allow (non-ASCII)."""
    lines = text.split("\n")
    here = lines[line - 1] if 0 < line <= len(lines) else ""
    where = f"{line}:{col}"
    header, pair = _HEADER.match(here), _KEY.match(here)
    if reason.startswith(("Cannot overwrite", "Cannot declare", "Cannot mutate")):
        if header:
            return f"table [{header.group(1)}] is declared twice (or clashes with a key)", where
        if pair:
            key = _dotted(_table_at(lines, line), pair.group(1))
            first = _first_set(lines, line, pair.group(1))
            again = f" (first set on line {first})" if first else ""
            return (f"duplicate key '{key}'{again}; keep one of them",
                    f"{line}:{here.index(pair.group(1)) + 1}")
        return reason, where
    raw = header.group(1) if header else pair.group(1) if pair else here.strip().split(" ")[0]
    odd = next((i for i, ch in enumerate(raw) if ord(ch) > 127), None)
    if odd is not None and not raw.lstrip().startswith(('"', "'")):
        column = here.index(raw) + odd + 1
        return (f"bare key '{raw}' holds a non-ASCII character ({raw[odd]!r}); a bare key "
                f"may use only A-Z a-z 0-9 _ -: quote it (\"{raw}\") or rename it",
                f"{line}:{column}")
    return reason, where


def _table_at(lines: list[str], line: int) -> str:
    """The [table] a line belongs to ('' for the top level)."""
    for text in reversed(lines[: line - 1]):
        header = _HEADER.match(text)
        if header and not text.lstrip().startswith("#"):
            return header.group(1)
    return ""


def _first_set(lines: list[str], line: int, key: str) -> int | None:
    """The earlier line of the same table that sets `key`, if any."""
    for number in range(line - 1, 0, -1):
        text = lines[number - 1]
        if _HEADER.match(text):
            return None
        pair = _KEY.match(text)
        if pair and _dotted("", pair.group(1)) == _dotted("", key):
            return number
    return None


def _dotted(table: str, key: str) -> str:
    key = ".".join(part.strip().strip('"').strip("'") for part in key.split("."))
    return f"{table}.{key}" if table else key



# ---------------------------------------------------------------------------- writing


def to_dict(cfg: Config, plan: CampaignPlan | None = None) -> dict:
    """The whole file as a TOML-shaped dict: every section and key, in file order, the
    [campaign] table at its defaults unless a plan is given."""
    run = config.to_dict(cfg)
    table = plan_mod.to_table(plan or CampaignPlan())
    return {name: table if name == SECTION else run[name] for name in FILE_SECTIONS}


def dumps_config(cfg: Config, plan: CampaignPlan | None = None) -> str:
    """The resolved file as TOML that loads back to an equal (Config, plan)."""
    return toml_io.dumps(to_dict(cfg, plan))


def diff(before: dict, after: dict) -> dict[str, tuple[Any, Any]]:
    """Key-by-key differences of two config tables: dotted key -> (before, after), sorted.
    A table inside a section is compared with its left-out keys at their defaults, so a key
    left out and the same key given at its default are no difference."""
    a, b = _with_table_defaults(flatten(before, FILE_SECTIONS)), \
        _with_table_defaults(flatten(after, FILE_SECTIONS))
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


def _with_table_defaults(flat: dict[str, Any]) -> dict[str, Any]:
    out = dict(flat)
    for key, cls in TABLES.items():
        table = out.get(key, {})
        if isinstance(table, dict):  # a hand-edited config.toml may hold anything
            out[key] = {f.name: f.default if f.default is not dataclasses.MISSING
                        else f.default_factory() for f in dataclasses.fields(cls)} | table
    return out


def flat_defaults() -> dict[str, Any]:
    """Every key a file may hold at its default, as dotted key -> value."""
    return flatten(to_dict(Config()), FILE_SECTIONS)


def describe_keys() -> list[tuple[str, str, Any, str]]:
    """(section, key, default, meaning) for every key a file may hold: the README's table."""
    rows = []
    for name, cls in FILE_SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            help_text = f.metadata.get("help", "")
            choices = f.metadata.get("choices")
            if choices:
                help_text += " (" + " | ".join(choices) + ")"
            rows.append((name, f.name, default, help_text))
    return rows

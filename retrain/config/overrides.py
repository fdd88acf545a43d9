"""Command-line overrides: `--set section.key=value` items and the shortcut flags, typed by
the schema and checked before the file is read.

Any key of the run may be set, and the plain [campaign] keys and [campaign.race]'s too (not
its conditions or grid, which belong in the file). Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from retrain.campaign import plan as plan_mod
from retrain.campaign.plan import FILE_SECTIONS, SECTION
from retrain.campaign.race_plan import TABLE, RacePlan
from retrain.config import toml_io
from retrain.config.schema import (
    check_field,
    did_you_mean,
    fields_of,
    hints_of,
    is_value_or_word,
    key_hint,
)
from retrain.config.sections import ConfigError, ConfigIssue


def parse_cli_value(section: str, key: str, text: str) -> Any:
    """Type a `--set` value by the schema: string keys take the text as is (or a quoted TOML
    string), every other key parses it as a TOML value (1e-4, true, [1, 2], {a = 1})."""
    parsed = _toml_value(text)
    tp = hints_of(FILE_SECTIONS[section])[key]
    if tp is str or (is_value_or_word(tp) and parsed is _NOT_TOML):
        return parsed if isinstance(parsed, str) else text
    return text if parsed is _NOT_TOML else parsed


_NOT_TOML = object()


def _toml_value(text: str) -> Any:
    try:
        return toml_io.loads(f"v = {text}")["v"]
    except toml_io.TOMLDecodeError:
        return _NOT_TOML


def parse_set_args(items: list[str], source: str = "command line") -> dict[str, Any]:
    """Turn ['training.lr=1e-4', ...] into typed dotted-key overrides, or raise ConfigError
    naming every bad item."""
    out: dict[str, Any] = {}
    issues = []
    for item in items:
        dotted, eq, text = (s.strip() for s in item.partition("="))
        if not eq or not dotted:
            issues.append(ConfigIssue(f"--set {item}", "expected section.key=value, "
                                      "e.g. --set training.lr=1e-4"))
            continue
        parsed = _cli_key(dotted)
        if isinstance(parsed, str):
            issues.append(ConfigIssue(f"--set {dotted}", parsed))
            continue
        section, key, rest = parsed
        if rest:  # inside a free-form table: any TOML value, else the text itself
            value = _toml_value(text)
            value = text if value is _NOT_TOML else value
        else:
            value = parse_cli_value(section, key, text)
        problem = _cli_override_problem(dotted, value)
        if problem:
            issues.append(ConfigIssue(f"--set {dotted}", problem))
        out[dotted] = value
    if issues:
        raise ConfigError(source, issues)
    return out


def _cli_key(dotted: str) -> tuple[str, str, list[str]] | str:
    """Like plan.split_key, but the command line may also set [campaign] keys, and the keys of
    [campaign.race] (`campaign.race.min_seeds=4`)."""
    parsed = plan_mod.split_key(dotted)
    parts = dotted.split(".")
    if parts[:2] == [SECTION, "race"] and len(parts) == 3 and parts[2]:
        return SECTION, "race", [parts[2]]
    if isinstance(parsed, str) and parts[0] == SECTION and len(parts) == 2 and parts[1]:
        if parts[1] in fields_of(FILE_SECTIONS[SECTION]):
            return SECTION, parts[1], []
        return f"unknown key '{dotted}'{key_hint(FILE_SECTIONS, SECTION, parts[1])}"
    return parsed


def _cli_override_problem(dotted: str, value: Any) -> str | None:
    parsed = _cli_key(dotted)
    if isinstance(parsed, str):
        return parsed
    if parsed[:2] == (SECTION, "race"):
        key = parsed[2][0]
        if key not in fields_of(RacePlan):
            return f"unknown key{did_you_mean(key, fields_of(RacePlan))}; [{TABLE}] takes " \
                   + ", ".join(fields_of(RacePlan))
        return check_field(RacePlan, key, value)[1]
    if parsed[0] == SECTION:
        if parsed[1] in ("conditions", "grid"):
            return f"set campaign.{parsed[1]} in the TOML file, not on the command line"
        return plan_mod.check_value(parsed[1], value)[1]
    return plan_mod.check_override(dotted, value)


# Command-line shortcuts for the most common overrides.
SHORTCUTS = {"--seed": "training.seed", "--max-steps": "training.max_steps",
             "--log-dir": "logging.log_dir", "--executor": "campaign.executor"}


def command_line_overrides(sets: list[str], shortcuts: dict[str, Any]) -> dict[str, Any]:
    """`--set` items plus shortcut flags ({'--seed': 3, ...}; None = not given) as validated
    dotted-key overrides; a shortcut wins over a --set of the same key."""
    try:
        out, issues = parse_set_args(list(sets)), []
    except ConfigError as exc:
        out, issues = {}, list(exc.issues)
    for flag, value in shortcuts.items():
        if value is None:
            continue
        dotted = SHORTCUTS[flag]
        section, key = dotted.split(".")
        problem = check_field(FILE_SECTIONS[section], key, value)[1]
        if problem:
            issues.append(ConfigIssue(f"{flag} ({dotted})", problem))
        out[dotted] = value
    if issues:
        raise ConfigError("command line", issues)
    return out


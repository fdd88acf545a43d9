"""What a config section is: fields with their meaning and bounds, one value checked against
them, and the errors that name the file, the key and the fix.

Generic over any section dataclass, so the run's sections (`config`) and the campaign's
(`campaign/plan`) share one way of checking and one way of reporting. Pure: no I/O.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from retrain.config import toml_io
from retrain.errors import UserError

# ---------------------------------------------------------------------------- size bounds

# What is physically meaningful, so that an absurd value (batch_size = 10**12) is a clear
# error before anything allocates, not a run that builds a 10**12-element list. Each bound is
# far beyond what today's largest runs use (a 1M-token context, 64k prompts per step).
MAX_BATCH = 65_536                # prompts per step
MAX_GROUP = 4_096                 # completions per prompt
MAX_COMPLETIONS = 1_048_576       # batch_size x group_size: completions sampled per step
MAX_TOKENS = 1_048_576            # new tokens per completion
MAX_TURNS = 10_000                # model turns in one episode
MAX_STEPS = 100_000_000
MAX_PROBLEMS = 10_000_000         # generated problems held in memory
MAX_THREADS = 4_096
MAX_LORA_RANK = 65_536
MAX_UPDATES = 1_024               # optimizer steps on one sampled batch (epochs)
MAX_WORKERS = 4_096               # campaign workers / concurrent API calls
MAX_WAIT_S = 604_800.0            # timeouts and gaps: a week (beyond, waits overflow timers)


def opt(default: Any, help: str, *, choices: tuple | None = None, lo: float | None = None,
        hi: float | None = None, lo_open: bool = False, factory: bool = False,
        words: tuple[str, ...] = ()) -> Any:
    """A config field with its meaning and allowed values attached. `words` are the strings an
    `int | str` or `bool | str` field takes besides its values (e.g. ("auto",))."""
    meta = {"help": help, "choices": choices, "lo": lo, "hi": hi, "lo_open": lo_open,
            "words": words}
    if factory:
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def fields_of(cls: type) -> dict[str, dataclasses.Field]:
    """The fields of one section class, by key."""
    return {f.name: f for f in dataclasses.fields(cls)}


@functools.cache
def hints_of(cls: type) -> dict[str, Any]:
    """The annotated type of each key of a section class (list[str], int, dict, ...)."""
    return typing.get_type_hints(cls)


# ---------------------------------------------------------------------------- errors


@dataclass
class ConfigIssue:
    """One problem found in a config: where, what, and how to fix it."""

    key: str
    message: str

    def render(self, source: str) -> str:
        where = f"{source}: {self.key}" if self.key else source
        return f"{where}: {self.message}"


class ConfigError(UserError):
    """Every problem found in one config file, reported together."""

    def __init__(self, source: str, issues: list[ConfigIssue]):
        self.source = source
        self.issues = issues
        super().__init__(self.render())

    def render(self) -> str:
        if len(self.issues) == 1:
            return self.issues[0].render(self.source)
        lines = [f"{self.source}: {len(self.issues)} problems"]
        lines += ["  - " + (f"{i.key}: {i.message}" if i.key else i.message) for i in self.issues]
        return "\n".join(lines)


def did_you_mean(word: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def key_hint(sections: Mapping[str, type], section: str | None, key: str) -> str:
    """Did-you-mean for an unknown key: a close key in the same section, else the section
    where that key really lives, else any close `section.key` (over every section a file may
    hold, so a key put in the wrong table points to its real home)."""
    if section in sections:
        close = difflib.get_close_matches(key, list(fields_of(sections[section])), n=1,
                                          cutoff=0.6)
        if close:
            return f" (did you mean '{section}.{close[0]}'?)"
    every = [f"{name}.{f.name}" for name, cls in sections.items() for f in dataclasses.fields(cls)]
    homes = [k for k in every if k.split(".", 1)[1] == key]
    if homes:
        return f" (did you mean '{homes[0]}'? '{key}' lives in [{homes[0].split('.')[0]}])"
    bare = {k.split(".", 1)[1]: k for k in every}
    close = difflib.get_close_matches(key, list(bare), n=1, cutoff=0.75)
    return f" (did you mean '{bare[close[0]]}'?)" if close else ""


def unknown_key(sections: Mapping[str, type], section: str, key: str) -> ConfigIssue:
    """`[section] key` names no field: say so, with a hint and the keys the section takes."""
    return ConfigIssue(f"{section}.{key}", f"unknown key{key_hint(sections, section, key)}; "
                       f"[{section}] takes " + ", ".join(fields_of(sections[section])))


def show(value: Any) -> str:
    return toml_io.format_value(value) if toml_io.is_tomlable(value) else repr(value)


# ---------------------------------------------------------------------------- value checking


_TYPE_NAMES = {str: ("a string", "strings"), int: ("an integer", "integers"),
               float: ("a number", "numbers"), bool: ("true or false", "booleans"),
               dict: ("a table", "tables")}


def _type_name(tp: Any) -> str:
    """'an integer', 'a list of strings', ...: what a key expects, in words."""
    if is_value_or_word(tp):
        return " or ".join(_TYPE_NAMES[a][0] for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return "a list of " + _TYPE_NAMES[typing.get_args(tp)[0]][1]
    return _TYPE_NAMES.get(tp, (str(tp), ""))[0]


def table_issues(cls: type, table: dict, name: str) -> list[ConfigIssue]:
    """Check a free-form TOML table (e.g. [reward.judge]) against the dataclass `cls` that
    describes it: unknown keys with a did-you-mean, bad values; good values are coerced in
    place. `name` is the table's dotted name."""
    issues, known = [], fields_of(cls)
    for key, value in table.items():
        if key not in known:
            issues.append(ConfigIssue(f"{name}.{key}", f"unknown key{did_you_mean(key, known)}"
                                      f"; [{name}] takes " + ", ".join(known)))
            continue
        value, problem = check_field(cls, key, value)
        if problem:
            issues.append(ConfigIssue(f"{name}.{key}", problem))
        else:
            table[key] = value
    return issues


def check_field(cls: type, key: str, value: Any) -> tuple[Any, str | None]:
    """Coerce `value` to the field's type and check its range; return (value, problem)."""
    tp = hints_of(cls)[key]
    shown = show(value)
    if is_value_or_word(tp):
        words = fields_of(cls)[key].metadata.get("words") or ()
        tp = typing.get_args(tp)[0]
        expected = f"expected {_type_name(tp)} or {' or '.join(show(w) for w in words)}"
        if isinstance(value, str):
            hint = did_you_mean(value, words)
            return value, None if value in words else f"{expected}, got {shown}{hint}"
        if not _is_type(value, tp):
            return value, f"{expected}, got {shown}"
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if typing.get_origin(tp) is list:
        inner = typing.get_args(tp)[0]
        if not isinstance(value, list) or not all(_is_type(v, inner) for v in value):
            return value, f"expected {_type_name(tp)}, got {shown}"
        if inner is float:
            value = [float(v) for v in value]
    elif not _is_type(value, tp):
        return value, f"expected {_type_name(tp)}, got {shown}"
    if tp is float and not math.isfinite(value):
        return value, f"must be a finite number, got {shown}"
    if tp is int and abs(value) >= 2**63:
        return value, f"is out of range (a 64-bit integer), got {shown}"
    if not toml_io.is_tomlable(value):
        return value, f"cannot be stored in TOML (invalid text?), got {shown}"
    return value, _bounds_problem(fields_of(cls)[key].metadata, value, shown)


def is_value_or_word(tp: Any) -> bool:
    """An `int | str`, `float | str` or `bool | str` field: a number (true or false), or one
    of the words its metadata names."""
    return typing.get_origin(tp) is types.UnionType and typing.get_args(tp) in (
        (int, str), (float, str), (bool, str))


def _bounds_problem(meta: Mapping[str, Any], value: Any, shown: str) -> str | None:
    if meta.get("choices") and value not in meta["choices"]:
        allowed = ", ".join(show(c) for c in meta["choices"])
        hint = did_you_mean(str(value), meta["choices"])
        return f"{shown} is not allowed; use one of {allowed}{hint}"
    lo, hi = meta.get("lo"), meta.get("hi")
    numeric = isinstance(value, (int, float))
    if numeric and lo is not None and (value < lo or (meta.get("lo_open") and value <= lo)):
        op = ">" if meta.get("lo_open") else ">="
        return f"must be {op} {format_bound(lo)}, got {shown}"
    if hi is not None and numeric and value > hi:
        return f"must be <= {format_bound(hi)}, got {shown}"
    return None


def format_bound(x: float) -> str:
    """A range bound as written in messages and docs: 1, not 1.0."""
    return str(int(x)) if float(x).is_integer() else str(x)


def _is_type(value: Any, tp: Any) -> bool:
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if tp is dict:
        return isinstance(value, dict)
    return isinstance(value, tp)


def set_field(section: Any, name: str, key: str, value: Any, issues: list[ConfigIssue]) -> None:
    """Check one known key of `[name]` and store it on `section`, or record the problem."""
    value, problem = check_field(type(section), key, value)
    if problem:
        issues.append(ConfigIssue(f"{name}.{key}", problem))
    else:
        setattr(section, key, copy.deepcopy(value))


def section_problem(sections: Mapping[str, type], name: str, body: Any) -> ConfigIssue | None:
    """What is wrong with top-level entry `name` of a file holding `sections`, if anything."""
    if name not in sections and not isinstance(body, dict):
        return ConfigIssue(name, "top-level keys are not allowed; every key belongs "
                           f"to a section{key_hint(sections, None, name)}")
    if name not in sections:
        return ConfigIssue(f"[{name}]", f"unknown section{did_you_mean(name, sections)}; "
                           "sections are " + ", ".join(sections))
    if not isinstance(body, dict):
        return ConfigIssue(name, f"must be a table ([{name}]), got {show(body)}")
    return None


def flatten(table: dict, sections: Mapping[str, type], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; keys that already hold dots are kept whole. Nested
    tables descend until they reach a key of one of `sections`."""
    out: dict[str, Any] = {}
    for k, v in table.items():
        full = f"{prefix}{k}"
        if isinstance(v, dict) and _descends(full, sections):
            out.update(flatten(v, sections, full + "."))
        else:
            out[full] = v
    return out


def _descends(dotted: str, sections: Mapping[str, type]) -> bool:
    parts = dotted.split(".")
    if len(parts) == 1:
        return parts[0] in sections
    if parts[0] in sections and len(parts) == 2:
        return parts[1] not in fields_of(sections[parts[0]])
    return False

"""Minimal TOML reading (stdlib tomllib) and writing for the value types configs hold.

We write TOML ourselves rather than add a dependency: configs hold only strings,
numbers, booleans, lists and tables, and the writer must round-trip them exactly.
"""

from __future__ import annotations

import math
import re
import tomllib
from typing import Any

TOMLDecodeError = tomllib.TOMLDecodeError
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
# Configs nest 4 levels ([[campaign.conditions]] with a table of overrides); far deeper values
# exhaust the recursion of tomllib and of every reader after it (RecursionError).
MAX_DEPTH = 64


def loads(text: str) -> dict:
    """Parse TOML text; values nested deeper than MAX_DEPTH are a TOMLDecodeError."""
    try:
        doc = tomllib.loads(text)
    except RecursionError:
        doc = None
    if doc is None or _deeper_than(doc, MAX_DEPTH):
        raise TOMLDecodeError(f"values nested deeper than {MAX_DEPTH} levels (arrays or "
                              "tables inside each other); flatten them")
    return doc


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether lists and tables nest more than `limit` levels (no recursion of its own)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item \
            if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def is_tomlable(value: Any) -> bool:
    """Whether `value` can be written as a TOML value."""
    if isinstance(value, str):
        return not any(0xD800 <= ord(ch) <= 0xDFFF for ch in value)
    if isinstance(value, (bool, int, float)):
        return True
    if isinstance(value, list):
        return all(is_tomlable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_tomlable(v) for k, v in value.items())
    return False


def format_key(key: str) -> str:
    """A bare key when possible, else a quoted one ("algorithm.advantage")."""
    return key if _BARE_KEY.fullmatch(key) else format_string(key)


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n",
            "\f": "\\f", "\r": "\\r"}


def format_string(text: str) -> str:
    """A TOML basic string: control characters and DEL escaped, everything else kept as is."""
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        elif 0xD800 <= ord(ch) <= 0xDFFF:
            raise TypeError(f"cannot write a lone surrogate ({ord(ch):#x}) as TOML")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def format_value(value: Any) -> str:
    """One TOML value, inline (tables become inline tables)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return format_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        inner = ", ".join(f"{format_key(k)} = {format_value(v)}" for k, v in value.items())
        return "{ " + inner + " }" if inner else "{}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def dumps(doc: dict) -> str:
    """Write a dict of tables as TOML. Lists of tables become [[arrays of tables]]."""
    lines: list[str] = []
    _write_table(doc, [], lines)
    return "\n".join(lines).strip() + "\n"


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _write_table(table: dict, path: list[str], lines: list[str]) -> None:
    scalars = {k: v for k, v in table.items()
               if not isinstance(v, dict) and not _is_table_array(v)}
    if path and (scalars or not table):
        lines.append("")
        lines.append("[" + ".".join(format_key(p) for p in path) + "]")
    for k, v in scalars.items():
        lines.append(f"{format_key(k)} = {format_value(v)}")
    for k, v in table.items():
        if isinstance(v, dict):
            if not path:
                _write_table(v, [k], lines)
            else:
                sub = [*path, k]
                if not v:
                    lines.append("")
                    lines.append("[" + ".".join(format_key(p) for p in sub) + "]")
                else:
                    _write_table(v, sub, lines)
        elif _is_table_array(v):
            for item in v:
                lines.append("")
                lines.append("[[" + ".".join(format_key(p) for p in [*path, k]) + "]]")
                for ik, iv in item.items():
                    lines.append(f"{format_key(ik)} = {format_value(iv)}")

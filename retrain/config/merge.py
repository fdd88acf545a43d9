"""Dotted-key overrides applied to a raw TOML-shaped dict (a condition's, `--set`'s), before
it is validated into a Config (`sections.from_dict`). Pure: no I/O."""

from __future__ import annotations

import copy
from typing import Any


def apply_overrides(raw: dict, overrides: dict[str, Any]) -> dict:
    """Return a copy of the raw dict with dotted-key overrides applied (free-form tables too).

    A table value merges into the table it overrides (recursively), so a condition that sets
    one backend option keeps the others."""
    out = copy.deepcopy(raw)
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node = out
        for p in parts[:-1]:
            if p not in node:
                node[p] = {}
            if not isinstance(node[p], dict):
                break  # the file holds a non-table here; validation reports it
            node = node[p]
        else:
            node[parts[-1]] = _merged(node.get(parts[-1]), value)
    return out


def _merged(old: Any, new: Any) -> Any:
    if isinstance(old, dict) and isinstance(new, dict):
        out = copy.deepcopy(old)
        for k, v in new.items():
            out[k] = _merged(out.get(k), v)
        return out
    return copy.deepcopy(new)

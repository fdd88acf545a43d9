"""A tool's OpenAI function schema, read from its type hints and docstring.

    def lookup(key: str, exact: bool = True) -> str:
        '''Look up the value stored under a name.

        Args:
            key: the name to look up.
            exact: match the name exactly.
        '''

gives {"type": "function", "function": {"name": "lookup", "description": "Look up the value
stored under a name.", "parameters": {"type": "object", "properties": {"key": {"type":
"string", "description": "the name to look up."}, ...}, "required": ["key"]}}}.
Pure: no I/O.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable
from typing import Any

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean",
               list: "array", tuple: "array", dict: "object"}


def function_schema(fn: Callable[..., Any], name: str | None = None) -> dict:
    """The OpenAI function schema of `fn` (parameters from its signature, descriptions from
    the first docstring paragraph and its `Args:` section)."""
    doc = inspect.getdoc(fn) or ""
    summary, arg_help = _parse_docstring(doc)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations: fall back to untyped parameters
        hints = {}
    properties: dict[str, dict] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or param.name == "self":
            continue
        prop = _json_type(hints.get(param.name, param.annotation))
        if param.name in arg_help:
            prop["description"] = arg_help[param.name]
        properties[param.name] = prop
        if param.default is param.empty:
            required.append(param.name)
    return {"type": "function",
            "function": {"name": name or fn.__name__,
                         "description": summary or f"The tool {name or fn.__name__}.",
                         "parameters": {"type": "object", "properties": properties,
                                        "required": required}}}


def _json_type(annotation: Any) -> dict:
    if annotation in (inspect.Parameter.empty, Any):
        return {}
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        return _json_type(options[0]) if len(options) == 1 else {}
    if origin in (list, tuple, set, frozenset):
        out: dict = {"type": "array"}
        if args and args[0] is not Ellipsis:
            item = _json_type(args[0])
            if item:
                out["items"] = item
        return out
    if origin is dict:
        return {"type": "object"}
    return {}


_ARGS_HEADER = re.compile(r"^(Args|Arguments|Parameters):\s*$")
_ARG_LINE = re.compile(r"^\s+(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(first paragraph, {arg: description}) of a Google-style docstring."""
    lines = doc.splitlines()
    summary: list[str] = []
    for line in lines:
        if not line.strip() or _ARGS_HEADER.match(line.strip()):
            break
        summary.append(line.strip())
    arg_help: dict[str, str] = {}
    current = ""
    in_args = False
    for line in lines:
        if _ARGS_HEADER.match(line.strip()):
            in_args = True
            continue
        if not in_args:
            continue
        if line.strip() and not line.startswith((" ", "\t")):
            break  # the next section (Returns:, ...)
        match = _ARG_LINE.match(line)
        indent = len(line) - len(line.lstrip())
        if match and (not current or indent <= _indent_of_args(lines)):
            current = match.group(1).lstrip("*")
            arg_help[current] = match.group(2).strip()
        elif current and line.strip():
            arg_help[current] = (arg_help[current] + " " + line.strip()).strip()
    return " ".join(summary), arg_help


def _indent_of_args(lines: list[str]) -> int:
    """The indentation of the first argument line under `Args:`."""
    after = False
    for line in lines:
        if _ARGS_HEADER.match(line.strip()):
            after = True
        elif after and line.strip():
            return len(line) - len(line.lstrip())
    return 0

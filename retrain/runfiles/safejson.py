"""One reader for JSON we did not write ourselves this instant: run files, manifests, data.

Files on disk can be torn by a crash, edited by hand or written by someone hostile. The
standard parser accepts documents that later break plain arithmetic or recursion (a
400-digit integer makes `float()` and `math.isfinite` raise OverflowError; 100 000 nested
brackets raise RecursionError), so every reader of such files parses through `loads`, which
rejects them like any other malformed text: a `BadJSON` (a ValueError) the caller counts or
reports. Non-finite numbers (`NaN`, `Infinity`, `1e999`) become None, as the writers store them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

MAX_DEPTH = 64            # our files nest 3 levels; 64 leaves room for user metadata
MAX_INT_DIGITS = 100      # beyond this a number means nothing here and overflows floats
MAX_FILE_BYTES = 64 << 20  # state.json and manifest.json are kilobytes


class BadJSON(ValueError):
    """Text that is not JSON, or JSON outside the limits above."""


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise BadJSON(f"an integer with {len(text.lstrip('-'))} digits (at most "
                      f"{MAX_INT_DIGITS})")
    return int(text)


def _parse_float(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


_DECODER = json.JSONDecoder(parse_int=_parse_int, parse_float=_parse_float,
                            parse_constant=lambda _name: None)


def loads(data: bytes | str) -> Any:
    """Parse one JSON document within the limits; raise BadJSON otherwise."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray) else data
        value = _DECODER.decode(text)
    except BadJSON:
        raise
    except UnicodeDecodeError:
        raise BadJSON("not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise BadJSON(f"invalid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise BadJSON(f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # e.g. an integer beyond Python's own digit limit
        raise BadJSON(str(exc)) from None
    if _depth_exceeds(value, MAX_DEPTH):
        raise BadJSON(f"nested deeper than {MAX_DEPTH} levels")
    if "\\u" in text and _has_lone_surrogate(value):
        raise BadJSON("a string with a lone surrogate escape (not text; printing it fails)")
    return value


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Iterative (a recursive walk is what must not happen on hostile input)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def read_object(path: str | Path, max_bytes: int = MAX_FILE_BYTES) -> dict:
    """A JSON object from a file. Raises FileNotFoundError when absent, OSError when it
    cannot be read, BadJSON when it is not one JSON object within the limits."""
    path = Path(path)
    with open(path, "rb") as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise BadJSON(f"larger than {max_bytes >> 20} MiB")
    if not data.strip():
        raise BadJSON("empty")
    value = loads(data)
    if not isinstance(value, dict):
        raise BadJSON(f"a JSON {type(value).__name__}, not an object")
    return value

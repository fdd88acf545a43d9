"""Output for `explain` and `status`: rich on a terminal, plain aligned text when piped.

rich is imported only when stdout is a terminal, so piped and scripted use stays fast.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from retrain.runfiles.runlog import json_safe


def stdout_is_terminal() -> bool:
    """Rich output only for a person at a terminal (TERM=dumb counts as piped)."""
    return sys.stdout.isatty() and os.environ.get("TERM") != "dumb"


@dataclass
class Table:
    """Rows of cells with headers; rendered the same way in plain text and rich."""

    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)
    title: str = ""


@dataclass(frozen=True)
class Block:
    """A line of text or a table; `gap` puts a blank line before it."""

    text: str = ""
    table: Table | None = None
    style: str = ""        # rich style of a text line ("bold", "red", ...)
    indent: str = ""       # plain text only
    gap: bool = False


def plain_blocks(blocks: list[Block]) -> list[str]:
    """Blocks as plain lines."""
    lines: list[str] = []
    for b in blocks:
        if b.gap:
            lines.append("")
        if b.table is not None:
            lines += plain_table(b.table, indent=b.indent)
        else:
            lines.append(b.indent + b.text)
    return lines


def rich_blocks(blocks: list[Block]) -> list[Any]:
    """Blocks as rich renderables (imports rich)."""
    from rich.text import Text

    return [rich_table(b.table) if b.table is not None else
            Text(("\n" if b.gap else "") + b.text, style=b.style) for b in blocks]


def plain_table(table: Table, indent: str = "") -> list[str]:
    """Aligned columns, no colour, no box drawing: friendly to grep and diff."""
    cells = [table.headers, *table.rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(table.headers))]
    lines = [table.title] if table.title else []
    for row in cells:
        text = "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
        lines.append(indent + text.rstrip())
    return lines


def rich_table(table: Table) -> Any:
    """The same table as a rich renderable (imports rich)."""
    from rich import box
    from rich.table import Table as RichTable

    out = RichTable(title=table.title or None, box=box.SIMPLE_HEAD, title_justify="left",
                    pad_edge=False)
    for h in table.headers:
        out.add_column(h, no_wrap=True, overflow="ellipsis")
    for row in table.rows:
        out.add_row(*[_style(c) for c in row])
    return out


_STATE_STYLES = {"running": "cyan", "completed": "green", "failed": "bold red",
                 "stale": "yellow", "interrupted": "yellow", "budget": "yellow", "pending": "dim"}


def _style(cell: str) -> Any:
    from rich.text import Text

    word = cell.split(" ", 1)[0]
    return Text(cell, style=_STATE_STYLES.get(word, ""))


def fmt_num(value: Any, digits: int = 3) -> str:
    """A compact number for a table cell; '-' for missing."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if abs(value) >= 1e15:  # a hand-edited or broken value: keep the cell short
        return f"{value:.{digits}g}"
    if isinstance(value, int) or float(value).is_integer() and abs(value) >= 1000:
        return f"{int(value)}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def fmt_seconds(value: float | None) -> str:
    """Step times: '0.84s', '12.3s', '-' when unknown."""
    if value is None:
        return "-"
    return f"{value:.3g}s"


def dump_json(obj: Any) -> str:
    """JSON for machines: NaN/inf become null, so every parser can read it."""
    return json.dumps(json_safe(obj), indent=2, sort_keys=False)


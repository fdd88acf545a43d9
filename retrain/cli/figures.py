"""The matplotlib plumbing every picture shares: the Figure class (an optional extra,
imported only when drawing) and writing a PNG with one clear error line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from retrain.errors import UserError


def figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise UserError("retrain plot needs matplotlib: pip install 'retrain[plot]'") from exc
    return Figure


def save_png(fig: Any, out: Path, dpi: int = 100) -> Path:
    """Write `fig` to `out` (its folder made), or one error line naming the file."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=dpi)
    except OSError as exc:
        raise UserError(f"{out}: cannot write the plot ({exc.strerror or exc})") from exc
    return out

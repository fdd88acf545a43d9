"""A run's bill from its folder: the sum of its metrics rows (retrain.bill.tally) priced by
the [cost] section of its config.toml; and bills summed (a condition, a campaign). For
`status` and `compare`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrain.bill.prices import Prices, price, usd_text
from retrain.bill.tally import Tally
from retrain.runfiles import runlog


@dataclass
class Bill:
    spent: Tally = field(default_factory=Tally)
    usd: float | None = None         # None: nothing priced
    unpriced: list[str] = field(default_factory=list)

    def __add__(self, other: Bill) -> Bill:
        usd = None if self.usd is None and other.usd is None else \
            (self.usd or 0.0) + (other.usd or 0.0)
        return Bill(self.spent + other.spent, usd,
                    list(dict.fromkeys(self.unpriced + other.unpriced)))

    def text(self) -> str:
        """'12345 tok, $0.0123' ('(part unpriced)' after it when some spend has no price;
        device-hours where nothing is priced); '-' for nothing."""
        t = self.spent
        if not t.tokens and not t.wall_s:
            return "-"
        if self.usd is None:
            return f"{t.tokens} tok, {t.device_hours:.3g} device-h"
        return f"{t.tokens} tok, {usd_text(self.usd)}" + (" (part unpriced)" if self.unpriced
                                                           else "")


def run_prices(folder: Path) -> Prices:
    """The run's [cost] prices (none when its config.toml is missing or unreadable)."""
    from retrain.config.cost_section import prices
    from retrain.config.loader import load_config

    path = Path(folder) / runlog.CONFIG_FILE
    if not path.is_file():
        return Prices()
    try:
        return prices(load_config(path).cost)
    except Exception:  # a broken config must not break status or compare
        return Prices()


def bill_of(rows: Iterable[Mapping[str, Any]], prices: Prices) -> Bill:
    spent = Tally.of_rows(rows)
    priced = price(spent, prices)
    return Bill(spent, priced.usd, priced.unpriced)


def run_bill(folder: Path, rows: list[dict] | None = None) -> Bill:
    """One run's bill (`rows`: its metrics rows, when already read)."""
    if rows is None:
        rows = runlog.read_metrics(Path(folder) / runlog.METRICS_FILE).rows
    return bill_of(rows, run_prices(folder))


def total(bills: Iterable[Bill]) -> Bill:
    out = Bill()
    for b in bills:
        out = out + b
    return out

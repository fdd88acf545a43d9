"""Prices ([cost], US dollars) applied to a tally, and budgets checked against it.

A part with no price is left out of the dollar figure and named as unpriced; with no price
at all there is no dollar figure (None), never a made-up one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from retrain.bill.tally import Tally

MTOK = 1_000_000


@dataclass(frozen=True)
class Prices:
    """Per-million-token prices and a device-hour price; None: not priced."""

    prefill_per_mtok: float | None = None
    sample_per_mtok: float | None = None
    train_per_mtok: float | None = None
    judge_input_per_mtok: float | None = None
    judge_output_per_mtok: float | None = None
    device_hour: float | None = None

    @property
    def any(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))

    def given(self) -> dict[str, float]:
        """The prices set, by key."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}


# price key -> (what it prices, in words; the tally's amount in the price's unit)
PARTS = {
    "prefill_per_mtok": ("prefill tokens", lambda t: t.prefill / MTOK),
    "sample_per_mtok": ("sampled tokens", lambda t: t.sampled / MTOK),
    "train_per_mtok": ("trained tokens", lambda t: t.trained / MTOK),
    "judge_input_per_mtok": ("judge input tokens", lambda t: t.judge_input / MTOK),
    "judge_output_per_mtok": ("judge output tokens", lambda t: t.judge_output / MTOK),
    "device_hour": ("device-hours", lambda t: t.device_hours),
}


@dataclass
class Bill:
    usd: float | None          # None: nothing is priced
    unpriced: list[str]        # parts spent with no price (words), left out of `usd`


def price(tally: Tally, prices: Prices) -> Bill:
    """The dollars of `tally` at `prices`, and the parts spent that have no price."""
    usd, unpriced = 0.0, []
    for key, (words, amount) in PARTS.items():
        rate = getattr(prices, key)
        if rate is not None:
            usd += rate * amount(tally)
        elif amount(tally) > 0:
            unpriced.append(words)
    return Bill(usd=usd if prices.any else None, unpriced=unpriced)


@dataclass(frozen=True)
class Budget:
    """A spending limit; 0 = none (`usd` needs prices to apply)."""

    usd: float = 0.0
    tokens: int = 0

    @property
    def any(self) -> bool:
        return self.usd > 0 or self.tokens > 0


def crossed(spent: Tally, prices: Prices, budget: Budget, keys: str = "training") -> str | None:
    """Why `spent` has reached `budget` (None: it has not); `keys`: the section named."""
    if budget.tokens and spent.tokens >= budget.tokens:
        return (f"spent {spent.tokens:,} tokens (prefill + sampled + trained), reaching "
                f"{keys}.budget_tokens = {budget.tokens:,}")
    usd = price(spent, prices).usd
    if budget.usd and usd is not None and usd >= budget.usd:
        return f"spent {usd_text(usd)}, reaching {keys}.budget_usd = {usd_text(budget.usd)}"
    return None


def usd_text(usd: float) -> str:
    """Dollars as shown: cents above a dollar, four decimals below."""
    return f"${usd:,.2f}" if abs(usd) >= 1 else f"${usd:.4f}"

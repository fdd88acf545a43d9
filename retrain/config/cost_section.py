"""[cost]: the prices of a run's spending, in US dollars, all optional ("none" = not priced).

No table of published prices ships: prices change and cannot be checked offline, so the
figures are the file's own. With no price, costs show in tokens and device-hours only.
Pure: no I/O. `training` below is the TrainingConfig (not imported: sections imports this).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from retrain.bill.prices import Budget, Prices
from retrain.config.schema import ConfigIssue, opt

NONE = "none"
MAX_PRICE = 1e9  # dollars per million tokens or per device-hour: beyond, a typo


def _price(help: str) -> float | str:
    return opt(NONE, f"{help}, in US dollars (none = not priced)", lo=0, hi=MAX_PRICE,
               words=(NONE,))


@dataclass
class CostConfig:
    prefill_per_mtok: float | str = _price("per million prompt tokens sent to sample (and "
                                           "reference log-prob) calls")
    sample_per_mtok: float | str = _price("per million sampled tokens")
    train_per_mtok: float | str = _price("per million tokens of the datums trained "
                                         "(forward_backward)")
    judge_input_per_mtok: float | str = _price("per million judge input tokens (the judge "
                                               "API's usage)")
    judge_output_per_mtok: float | str = _price("per million judge output tokens")
    device_hour: float | str = _price("per hour of the run's wall time (a local device)")


def prices(cost: CostConfig) -> Prices:
    """The section's prices (the ones set)."""
    return Prices(**{f.name: None if getattr(cost, f.name) == NONE else
                     float(getattr(cost, f.name)) for f in fields(cost)})


def training_budget(training) -> Budget:
    return Budget(usd=training.budget_usd, tokens=training.budget_tokens)


def cost_issues(cost: CostConfig, training, section: str = "training") -> list[ConfigIssue]:
    """A money budget with nothing to price the run by (`training`: [training], or the
    [campaign] plan, which holds the same budget keys)."""
    if training.budget_usd and not prices(cost).any:
        return [ConfigIssue(f"{section}.budget_usd", f"= {training.budget_usd:g} needs a "
                            "price to count dollars by: set one in [cost] (e.g. device_hour "
                            f"or sample_per_mtok), or use {section}.budget_tokens")]
    return []


def campaign_cost_issues(cost: CostConfig, plan) -> list[ConfigIssue]:
    return cost_issues(cost, plan, "campaign")

"""[campaign] budget_usd / budget_tokens: the campaign's spend (the sum of its runs' rows)
against its budget. The runner starts no run once the spend has reached it, and hands each
run it starts the rest, as that run's own [training] budget, so a running run stops at the
step where the campaign crosses (runs/spend.py stops it; it resumes when the budget is
raised). Runs that run at once are each handed the whole rest: together they may pass it
by what they spend in parallel before one of them stops.
"""

from __future__ import annotations

from pathlib import Path

from retrain.bill.prices import Budget, crossed, price
from retrain.bill.tally import Tally
from retrain.campaign.plan import CampaignPlan
from retrain.config.cost_section import prices
from retrain.config.sections import Config
from retrain.runfiles import runlog


def run_spend(run_dir: Path) -> Tally:
    """What one run has spent: the sum of its rows."""
    return Tally.of_rows(runlog.read_metrics(run_dir / runlog.METRICS_FILE).rows)


class CampaignBudget:
    def __init__(self, cfg: Config, plan: CampaignPlan, run_dirs: list[Path]):
        self.budget = Budget(usd=plan.budget_usd, tokens=plan.budget_tokens)
        self.prices, self.run_dirs = prices(cfg.cost), run_dirs

    def spent(self) -> Tally:
        total = Tally()
        for run_dir in self.run_dirs:
            total = total + run_spend(run_dir)
        return total

    def refusal(self) -> str | None:
        """Why no further run may start (None: the budget allows one, or there is none)."""
        if not self.budget.any:
            return None
        return crossed(self.spent(), self.prices, self.budget, "campaign")

    def handed(self, run: Config, run_dir: Path) -> dict[str, float | int]:
        """The [training] budget keys of a run about to start: what it spent already plus
        the rest of the campaign's budget (or its own budget, where that binds first)."""
        if not self.budget.any:
            return {}
        spent, own = self.spent(), run_spend(run_dir)
        out: dict[str, float | int] = {}
        if self.budget.tokens:
            rest = own.tokens + max(self.budget.tokens - spent.tokens, 1)
            out["training.budget_tokens"] = min(rest, run.training.budget_tokens or rest)
        if self.budget.usd:
            usd = price(spent, self.prices).usd or 0.0
            rest_usd = (price(own, self.prices).usd or 0.0) + max(self.budget.usd - usd, 1e-9)
            out["training.budget_usd"] = min(rest_usd, run.training.budget_usd or rest_usd)
        return out

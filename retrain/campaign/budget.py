"""[campaign] budget_usd / budget_tokens: the campaign's spend (the sum of its runs' rows)
against its budget. The runner starts no run once the spend has reached it, nor a run whose
upper bound (explain's, handed in as `bound_of`) would cross it on top of the spend so far:
its rows can never spend more than that bound, bar device-hours and judge tokens, which have
none before the run. It hands each run it starts the rest, as that run's own [training]
budget, so a running run stops at the step where the campaign crosses (runs/spend.py stops
it; it resumes when the budget is raised). Runs that run at once are each handed the whole
rest: together they may pass it by what they spend in parallel before one of them stops.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from retrain.bill.estimate import Bound, rest
from retrain.bill.prices import Budget, crossed, price, usd_text
from retrain.bill.tally import Tally
from retrain.campaign.plan import CampaignPlan
from retrain.config.cost_section import prices
from retrain.config.sections import Config
from retrain.errors import UserError
from retrain.runfiles import runlog

BoundOf = Callable[[Config], Bound]  # a run's upper bound from its config


def run_spend(run_dir: Path) -> Tally:
    """What one run has spent: the sum of its rows."""
    return Tally.of_rows(runlog.read_metrics(run_dir / runlog.METRICS_FILE).rows)


class CampaignBudget:
    def __init__(self, cfg: Config, plan: CampaignPlan, run_dirs: list[Path],
                 bound_of: BoundOf | None = None):
        self.budget = Budget(usd=plan.budget_usd, tokens=plan.budget_tokens)
        self.prices, self.run_dirs, self.bound_of = prices(cfg.cost), run_dirs, bound_of

    def spent(self) -> Tally:
        total = Tally()
        for run_dir in self.run_dirs:
            total = total + run_spend(run_dir)
        return total

    def refusal(self, run: Config, run_dir: Path) -> str | None:
        """Why `run` may not start (None: the budget allows it, or there is none): the spend
        has reached the budget, or the run's bound (less what it spent already) would cross
        it on top of that spend."""
        if not self.budget.any:
            return None
        spent = self.spent()
        if why := crossed(spent, self.prices, self.budget, "campaign"):
            return why
        try:
            bound = self.bound_of(run) if self.bound_of else None
        except UserError:  # data the run will refuse: its own one-line error, when it runs
            return None
        return None if bound is None else self._crosses(spent, bound, run_spend(run_dir))

    def _crosses(self, spent: Tally, bound: Bound, own: Tally) -> str | None:
        more = rest(bound, own)
        partial = (f" (a bound without {', '.join(bound.left_out)})" if bound.left_out
                   else "")
        if self.budget.tokens and spent.tokens + more.tokens > self.budget.tokens:
            return (f"its bound of {more.tokens:,} more tokens{partial} after {spent.tokens:,} "
                    f"spent would cross campaign.budget_tokens = {self.budget.tokens:,}")
        now = price(spent, self.prices).usd or 0.0
        then = price(more, self.prices).usd or 0.0
        if self.budget.usd and now + then > self.budget.usd:
            return (f"its bound of {usd_text(then)} more{partial} after {usd_text(now)} spent "
                    f"would cross campaign.budget_usd = {usd_text(self.budget.usd)}")
        return None

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

"""What `retrain explain` says about a campaign's race ([campaign.race]): its plan (the seeds
after which it decides, the most and fewest runs it can take), and the race the run would refuse
(a metric some condition's runs do not produce), refused here too, in the same line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from retrain.campaign.plan import CampaignPlan
from retrain.campaign.race import bounds, percent, schedule
from retrain.campaign.race_plan import RacePlan, race_of
from retrain.campaign.race_runs import check_runs
from retrain.config.sections import Config


def race_line(path: Path, camp: CampaignPlan, conditions: list[str],
              run_cfgs: dict[str, Config], seeds: int) -> str:
    """The race's plan in one line ('' without a race); ConfigError when the run would refuse
    it. `run_cfgs`: one run config per condition."""
    race = race_of(camp.race)
    if race is None:
        return ""
    check_runs(race, run_cfgs, str(path))
    sched = schedule(race, seeds, len(conditions))
    fewest, most = bounds(race, seeds, len(conditions))
    rounds = f"rounds of {race.round_seeds}" if len(sched.looks) > 1 else "one decision"
    extra = (f", margin {race.margin:g}" if race.margin else "") + (
        f", budget {race.budget_runs} runs" if race.budget_runs else "") + (
        f", interim share {race.interim_share:g}"
        if race.interim_share != RacePlan.interim_share else "")
    what = f"{race.metric} ({race.direction}" + (
        f", threshold {race.threshold_value:g}" if race.threshold_value is not None else "")
    levels = dict.fromkeys(percent(c) for c in (min(sched.confidences), max(sched.confidences)))
    return (f"{what}) at confidence {race.confidence:g}{extra}: decisions after "
            f"{', '.join(map(str, sched.looks))} seeds ({rounds}; each pair's interval at "
            f"{' to '.join(levels)}); at least "
            f"{fewest} runs, at most {most} of the grid's {len(conditions) * sched.looks[-1]} "
            "(docs/campaigns.md#racing)")


def race_settings(path: Path, camp: CampaignPlan, plans: list[Any],
                  run_cfgs: list[Config]) -> dict[str, str]:
    """{"race": the plan's line} for explain's settings ({} without a race); `plans` are
    explain's run plans (condition, seed), `run_cfgs` their configs, in the same order."""
    if not camp.is_campaign or not camp.race:
        return {}
    conditions = list(dict.fromkeys(p.condition for p in plans))
    by_condition = dict(zip((p.condition for p in plans), run_cfgs, strict=True))
    seeds = len(dict.fromkeys(p.seed for p in plans))
    return {"race": race_line(path, camp, conditions, by_condition, seeds)}

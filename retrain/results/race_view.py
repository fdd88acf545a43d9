"""A raced campaign's race in words, from manifest.json's `race`: what `retrain status` and
`retrain compare` show (each condition's state with the interval that justified it, and the runs
saved). A manifest edited by hand or torn shows as unreadable, never as a traceback."""

from __future__ import annotations

from typing import Any

from retrain.campaign.race import RaceState
from retrain.campaign.race_plan import RacePlan
from retrain.campaign.race_record import RaceRecordError, read_record
from retrain.campaign.race_runs import standing_line


def race_lines(race: Any, manifest: str = "manifest.json") -> list[str]:
    """The race's header, one line per condition, and the runs; [] without a race. `manifest`:
    the file it was read from, named when it cannot be read."""
    if not isinstance(race, dict) or not race.get("plan"):
        return []
    try:
        record = read_record(race)
    except RaceRecordError as exc:
        return [f"race: {manifest}'s race is unreadable ({exc}); the runs' own figures are "
                "intact"]
    plan, state, runs = record.plan, record.state, record.runs
    return [header(plan, state, record.looks),
            *[standing_line(c, s, plan) for c, s in state.standings.items()],
            f"runs: {runs['taken']} of the grid's {runs['full']} taken or planned, "
            f"{runs['saved']} saved" + (" so far" if state.outcome == "racing" else "")]


def header(plan: RacePlan, state: RaceState, looks: list[int]) -> str:
    """'race on final_reward (max, confidence 0.95): ...' with where it stands."""
    done = len(state.looks)
    where = {"racing": f"{done} of at most {len(looks)} decisions made",
             "winner": f"a winner after {done} decision{'s' if done != 1 else ''}",
             "equivalent": f"the rest equivalent within {plan.margin:g} after {done}",
             "max_seeds": f"max_seeds ({looks[-1]}) reached without a verdict",
             "budget": f"budget_runs ({plan.budget_runs}) reached without a verdict",
             "no_figures": "stopped: fewer than 2 conditions with figures left to compare"}
    return (f"race on {plan.metric} ({plan.direction}, confidence {plan.confidence:g}; "
            f"decisions after {', '.join(map(str, looks))} seeds): "
            f"{where.get(state.outcome, state.outcome)}")

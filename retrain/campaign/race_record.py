"""manifest.json's `race` read back field by field: every value checked for its type, and a
problem named by its path (`race.state.standings.bad.why.diff: expected a number, got "0.5"`),
so a hand-edited or torn manifest is one line, never a traceback or a string shown as a figure.
Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from retrain.campaign.race import OUTCOMES, STATES, Comparison, Look, RaceState, Standing
from retrain.campaign.race_plan import RacePlan
from retrain.config.schema import show, table_issues


class RaceRecordError(ValueError):
    """A field of the record missing or of the wrong type; the message starts with its path."""


@dataclass
class RaceRecord:
    """What `retrain status` and `compare` show of a race: its plan, its state, the seed counts
    of its planned decisions and its runs (taken, saved, full)."""

    plan: RacePlan
    state: RaceState
    looks: list[int]
    runs: dict[str, int]


def read_record(race: Any) -> RaceRecord:
    """The whole of manifest.json's `race` (RaceRecordError naming the first bad field)."""
    schedule = _table(race, "schedule", "race")
    runs = _table(race, "runs", "race")
    return RaceRecord(plan=read_plan(_get(race, "plan", "race")),
                      state=read_state(_get(race, "state", "race")),
                      looks=_ints(schedule, "looks", "race.schedule"),
                      runs={k: _int(runs, k, "race.runs") for k in ("taken", "saved", "full")})


def read_plan(plan: Any, at: str = "race.plan") -> RacePlan:
    if not isinstance(plan, dict):
        raise RaceRecordError(f"{at}: expected a table, got {_show(plan)}")
    table = dict(plan)
    issues = table_issues(RacePlan, table, at)
    if issues:
        raise RaceRecordError(f"{issues[0].key}: {issues[0].message}")
    return RacePlan(**table)


def read_state(state: Any, at: str = "race.state") -> RaceState:
    conditions = _texts(state, "conditions", at)
    looks = _get(state, "looks", at)
    if not isinstance(looks, list):
        raise RaceRecordError(f"{at}.looks: expected a list, got {_show(looks)}")
    standings = _table(state, "standings", at)
    outcome = _text(state, "outcome", at)
    if outcome not in OUTCOMES:
        raise RaceRecordError(f"{at}.outcome: expected one of {', '.join(OUTCOMES)}, got "
                              f"{_show(outcome)}")
    return RaceState(
        conditions=conditions, seeds=_ints(state, "seeds", at),
        looks=[_look(x, f"{at}.looks[{i}]") for i, x in enumerate(looks)],
        standings={c: _standing(s, f"{at}.standings.{c}") for c, s in standings.items()},
        outcome=outcome)


def _look(look: Any, at: str) -> Look:
    values = _table(look, "values", at)
    return Look(number=_int(look, "number", at), seeds=_ints(look, "seeds", at),
                confidence=_number(look, "confidence", at),
                values={c: _figures(v, f"{at}.values.{c}") for c, v in values.items()},
                eliminated=_texts(look, "eliminated", at),
                resolution=_number(look, "resolution", at) if "resolution" in look else 0.0)


def _figures(values: Any, at: str) -> dict[int, float]:
    if not isinstance(values, dict):
        raise RaceRecordError(f"{at}: expected a table, got {_show(values)}")
    out = {}
    for seed in values:
        try:
            key = int(seed)
        except ValueError:
            raise RaceRecordError(f"{at}: expected seeds as keys, got {_show(seed)}") from None
        out[key] = _number(values, seed, at)
    return out


def _standing(s: Any, at: str) -> Standing:
    state = _text(s, "state", at)
    if state not in STATES:
        raise RaceRecordError(f"{at}.state: expected one of {', '.join(STATES)}, got "
                              f"{_show(state)}")
    why = _get(s, "why", at)
    return Standing(state=state, look=_int(s, "look", at), seeds=_int(s, "seeds", at),
                    mean=_number(s, "mean", at, none=True),
                    why=None if why is None else _comparison(why, f"{at}.why"))


def _comparison(c: Any, at: str) -> Comparison:
    return Comparison(condition=_text(c, "condition", at), other=_text(c, "other", at),
                      diff=_number(c, "diff", at), lo=_number(c, "lo", at),
                      hi=_number(c, "hi", at), seeds=_ints(c, "seeds", at),
                      confidence=_number(c, "confidence", at))


# ---------------------------------------------------------------------------- one field


def _get(d: Any, key: str, at: str) -> Any:
    if not isinstance(d, dict):
        raise RaceRecordError(f"{at}: expected a table, got {_show(d)}")
    if key not in d:
        raise RaceRecordError(f"{at}.{key}: missing")
    return d[key]


def _table(d: Any, key: str, at: str) -> dict:
    value = _get(d, key, at)
    if not isinstance(value, dict):
        raise RaceRecordError(f"{at}.{key}: expected a table, got {_show(value)}")
    return value


def _number(d: Any, key: str, at: str, *, none: bool = False) -> Any:
    value = _get(d, key, at)
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise RaceRecordError(f"{at}.{key}: expected a number, got {_show(value)}")
    return float(value)


def _int(d: Any, key: str, at: str) -> int:
    value = _get(d, key, at)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RaceRecordError(f"{at}.{key}: expected an integer, got {_show(value)}")
    return value


def _ints(d: Any, key: str, at: str) -> list[int]:
    value = _get(d, key, at)
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int)
                                          for v in value):
        raise RaceRecordError(f"{at}.{key}: expected a list of integers, got {_show(value)}")
    return list(value)


def _text(d: Any, key: str, at: str) -> str:
    value = _get(d, key, at)
    if not isinstance(value, str):
        raise RaceRecordError(f"{at}.{key}: expected a string, got {_show(value)}")
    return value


def _texts(d: Any, key: str, at: str) -> list[str]:
    value = _get(d, key, at)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RaceRecordError(f"{at}.{key}: expected a list of strings, got {_show(value)}")
    return list(value)


def _show(value: Any) -> str:
    """A value as the manifest holds it, cut short (a hand edit may paste anything)."""
    text = show(value)
    return text if len(text) <= 60 else text[:57] + "..."

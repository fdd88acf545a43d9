"""The decisions of a race (docs/campaigns.md, "Racing"): after each round of seeds, which
conditions are behind beyond doubt, whether one is best beyond doubt or those left are
equivalent within the margin, and which seeds run next. Pure: no I/O. The runner feeds it each
finished run's figure and keeps its state in manifest.json, so a killed runner resumes it.

The method: a group-sequential design with alpha spending (Lan & DeMets 1983), made exact by
Bonferroni's inequality instead of the joint distribution of the looks. The race looks at
n_1 < n_2 < ... < n_K seeds (min_seeds, then round_seeds more each round, up to max_seeds).
Look k spends alpha_k = A(n_k / n_K) - A(n_{k-1} / n_K) of alpha = 1 - confidence, with
A(t) = s * alpha * t before the last look and A(1) = alpha, s = the plan's interim_share.
Its default 0.2 is the Haybittle-Peto shape: the last look keeps most of alpha, so the race
loses little power against the full grid while a large difference can stop it early; 1 spends
alpha evenly over the seeds (interim looks stop sooner, the last decides less). At look k
every pair of conditions still racing gets the paired t interval of its per-seed differences at
confidence 1 - alpha_k / P, P = the number of pairs of the campaign's conditions. The intervals
are exact for normal differences, so the chance that any interval of the whole race misses its
pair's true mean difference is at most sum_k P * alpha_k / P = alpha, whatever the looks
decided. While none misses: a truly best condition is never eliminated, no "winner" is false,
and no "equivalent" is false.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from retrain.campaign.race_plan import RacePlan
from retrain.results.stats import paired_interval, t_quantile

STATES = ("racing", "eliminated", "winner", "equivalent", "undecided", "no_figures")
OUTCOMES = ("racing", "winner", "equivalent", "max_seeds", "budget", "no_figures")


@dataclass(frozen=True)
class Schedule:
    """The planned looks: seeds per condition at each, and the per-pair interval confidence."""

    looks: tuple[int, ...]
    confidences: tuple[float, ...]
    pairs: int


@dataclass
class Comparison:
    """condition - other over the seeds both have, with its interval at the look's confidence."""

    condition: str
    other: str
    diff: float
    lo: float
    hi: float
    seeds: list[int]
    confidence: float


@dataclass
class Standing:
    """Where one condition is: its state, the look (1-based) that set it (0 while racing), the
    seeds it had results for then, its mean, and the interval that justified the state."""

    state: str = "racing"
    look: int = 0
    seeds: int = 0
    mean: float | None = None
    why: Comparison | None = None


@dataclass
class Look:
    """One decision: its number (1-based), the seeds it read, the per-pair confidence of its
    intervals, every figure it read (condition -> seed -> value), whom it eliminated, and the
    figure's resolution (its grid's step, 1 / eval problems for an accuracy; 0: none known)."""

    number: int
    seeds: list[int]
    confidence: float
    values: dict[str, dict[int, float]]
    eliminated: list[str] = field(default_factory=list)
    resolution: float = 0.0


@dataclass
class RaceState:
    """The whole race: the conditions and seeds (in order) it draws from, its looks so far, each
    condition's standing and the outcome (racing until it ends)."""

    conditions: list[str]
    seeds: list[int]
    looks: list[Look] = field(default_factory=list)
    standings: dict[str, Standing] = field(default_factory=dict)
    outcome: str = "racing"

    def racing(self) -> list[str]:
        return [c for c in self.conditions if self.standings[c].state == "racing"]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for look in data["looks"]:
            look["values"] = {c: {str(s): v for s, v in vals.items()}
                              for c, vals in look["values"].items()}
        return data


# ---------------------------------------------------------------------------- the plan


def percent(confidence: float) -> str:
    """A per-look confidence as a percentage to 4 decimals, trailing zeros dropped: 95% and
    99.7267%, not 95.0000%."""
    return f"{confidence * 100:.4f}".rstrip("0").rstrip(".") + "%"


def spent(t: float, alpha: float, share: float) -> float:
    """The alpha spent once a fraction t of the most seeds has been looked at, `share` of it
    before the last look."""
    return alpha if t >= 1 else share * alpha * t


def schedule(race: RacePlan, seeds: int, conditions: int) -> Schedule:
    """The looks of a race over `seeds` seeds and `conditions` conditions."""
    top = race.seeds_cap(seeds)
    looks = list(range(race.min_seeds, top, race.round_seeds)) + [top]
    alpha = 1.0 - race.confidence
    pairs = max(1, conditions * (conditions - 1) // 2)
    levels, before = [], 0.0
    for n in looks:
        now = spent(n / top, alpha, race.interim_share)
        levels.append(1.0 - (now - before) / pairs)
        before = now
    return Schedule(tuple(looks), tuple(levels), pairs)


def new_race(conditions: list[str], seeds: list[int]) -> RaceState:
    return RaceState(conditions=list(conditions), seeds=list(seeds),
                     standings={c: Standing() for c in conditions})


def wanted(state: RaceState, race: RacePlan) -> dict[str, list[int]]:
    """The seeds each condition runs so far: those of the look it stopped at, the next look's
    while it is racing (none once the race is over)."""
    looks = schedule(race, len(state.seeds), len(state.conditions)).looks
    nxt = len(state.looks)
    out = {}
    for c in state.conditions:
        s = state.standings[c]
        if s.state == "racing" and state.outcome == "racing":
            n = looks[nxt]
        else:
            n = looks[(s.look or len(state.looks)) - 1] if state.looks else 0
        out[c] = state.seeds[:n]
    return out


def runs_taken(state: RaceState, race: RacePlan) -> int:
    return sum(len(v) for v in wanted(state, race).values())


def bounds(race: RacePlan, seeds: int, conditions: int) -> tuple[int, int]:
    """The fewest and the most runs the race can take."""
    sched = schedule(race, seeds, conditions)
    most = conditions * sched.looks[-1]
    if race.budget_runs:
        most = min(most, race.budget_runs)
    return conditions * sched.looks[0], most


# ---------------------------------------------------------------------------- a decision


def decide(state: RaceState, race: RacePlan, values: dict[str, dict[int, float]],
           resolution: float = 0.0) -> RaceState:
    """The next look: `values` holds each racing condition's figure per seed (finished runs
    only; seeds beyond this look are ignored), `resolution` the figure's grid step (see
    `compare`). Returns the new state; `state` is unchanged."""
    if state.outcome != "racing":
        raise ValueError(f"the race is over ({state.outcome})")
    sched = schedule(race, len(state.seeds), len(state.conditions))
    k = len(state.looks)
    seeds = state.seeds[:sched.looks[k]]
    racing = state.racing()
    vals = {c: {s: float(values[c][s]) for s in seeds if s in values.get(c, {})}
            for c in racing}
    look = Look(number=k + 1, seeds=list(seeds), confidence=sched.confidences[k], values=vals,
                resolution=resolution)
    means = {c: _mean(v) for c, v in vals.items()}
    standings = {c: replace(s, mean=means[c], seeds=len(vals[c])) if c in vals else s
                 for c, s in state.standings.items()}  # (earlier looks are never changed)
    for c in racing:  # every run of it ended without a figure (failed for good): no more seeds
        if not vals[c]:
            standings[c] = Standing("no_figures", k + 1, 0)
    new = replace(state, looks=[*state.looks, look], standings=standings)
    look.eliminated = _eliminate(new, race, look, leader(racing, means, race.direction))
    _conclude(new, race, sched, look, means)
    return new


def leader(racing: list[str], means: dict[str, float | None], direction: str) -> str | None:
    """The condition with the best mean (the first of a tie); None when none has a figure."""
    scored = [c for c in racing if means[c] is not None]
    if not scored:
        return None
    sign = 1.0 if direction == "max" else -1.0
    return max(scored, key=lambda c: (sign * means[c], -racing.index(c)))


def compare(look: Look, a: str, b: str) -> Comparison | None:
    """a - b over the seeds both have at this look. None with fewer than 2. Figures on a grid
    (an accuracy over few problems, steps) repeat a difference by chance, so the differences'
    standard deviation is floored at one step of the grid (`look.resolution`): the same
    2/64 on three seeds is no evidence, 20/64 on every seed is. Without a known grid, a
    difference without spread gives no interval. Two conditions equal everywhere: no interval
    when their figures do not vary either (both score 0 everywhere say nothing about each
    other), else [0, 0] (the same computation, e.g. two losses that make the same update)."""
    shared = sorted(look.values[a].keys() & look.values[b].keys())
    if len(shared) < 2:
        return None
    ours = [look.values[a][s] for s in shared]
    diff, lo, hi = paired_interval(ours, [look.values[b][s] for s in shared], look.confidence)
    flat = hi - lo <= 1e-9 * abs(diff)  # no spread, up to float rounding
    if flat and diff == 0:
        if max(ours) == min(ours):
            return None
    elif look.resolution > 0:
        lo, hi = _floored(diff, lo, hi, len(shared), look)
    elif flat:
        return None
    return Comparison(a, b, diff, lo, hi, shared, look.confidence)


def _floored(diff: float, lo: float, hi: float, n: int, look: Look) -> tuple[float, float]:
    """The interval with the differences' standard deviation at least one grid step."""
    t = t_quantile(n - 1, look.confidence)
    sd = max((hi - lo) / 2 * math.sqrt(n) / t, look.resolution)
    half = t * sd / math.sqrt(n)
    return diff - half, diff + half


def beats(c: Comparison, direction: str) -> bool:
    """Whether c.condition is better than c.other beyond doubt."""
    return c.lo > 0 if direction == "max" else c.hi < 0


def _eliminate(state: RaceState, race: RacePlan, look: Look, top: str | None) -> list[str]:
    """Every racing condition some other racing one beats beyond doubt (never the leader);
    its standing keeps the strongest such interval."""
    out = []
    racing = list(look.values)
    for j in racing:
        if j == top:
            continue
        against = [c for i in racing if i != j and (c := compare(look, j, i)) is not None
                   and beats(_flip(c), race.direction)]
        if against:
            strongest = min(against, key=lambda c: c.hi) if race.direction == "max" \
                else max(against, key=lambda c: c.lo)
            state.standings[j] = Standing("eliminated", look.number, len(look.values[j]),
                                          state.standings[j].mean, strongest)
            out.append(j)
    return out


def _flip(c: Comparison) -> Comparison:
    return Comparison(c.other, c.condition, -c.diff, -c.hi, -c.lo, c.seeds, c.confidence)


def _conclude(state: RaceState, race: RacePlan, sched: Schedule, look: Look,
              means: dict[str, float | None]) -> None:
    """After the eliminations: a winner, an equivalence, the last look or the budget end the
    race (those left get their final state); else it goes on."""
    left = state.racing()
    top = leader(left, means, race.direction)
    dropped = any(s.state == "no_figures" for s in state.standings.values())
    if len(left) < 2 and (dropped or not left):
        # nothing left to compare with: one left is not best beyond doubt over a condition
        # without figures
        _settle(state, left, "undecided", look, {}, "no_figures")
        return
    if len(left) == 1:
        rivals = sorted(look.eliminated, key=lambda c: _rank(means[c], race.direction))
        why = next((c for r in rivals if (c := compare(look, left[0], r)) is not None), None)
        _settle(state, left, "winner", look, {left[0]: why}, "winner")
        return
    against_top = {c: compare(look, c, top) if top and c != top else None for c in left}
    if top is not None:
        runner_up = min((c for c in left if c != top),
                        key=lambda c: _rank(means[c], race.direction))
        against_top[top] = compare(look, top, runner_up)
    if race.margin > 0 and _equivalent(look, left, race.margin):
        _settle(state, left, "equivalent", look, against_top, "equivalent")
    elif look.number == len(sched.looks):
        _settle(state, left, "undecided", look, against_top, "max_seeds")
    elif race.budget_runs and runs_taken(state, race) > race.budget_runs:
        # (runs_taken counts the next round of those still racing: it would overrun)
        _settle(state, left, "undecided", look, against_top, "budget")


def _rank(mean: float | None, direction: str) -> float:
    """Sort key: the best mean first, conditions without a figure last."""
    if mean is None:
        return math.inf
    return -mean if direction == "max" else mean


def _equivalent(look: Look, left: list[str], margin: float) -> bool:
    """Every pair left has an interval inside (-margin, margin)."""
    for i, a in enumerate(left):
        for b in left[i + 1:]:
            c = compare(look, a, b)
            if c is None or not (-margin < c.lo and c.hi < margin):
                return False
    return True


def _settle(state: RaceState, names: list[str], to: str, look: Look,
            why: dict[str, Comparison | None], outcome: str) -> None:
    for c in names:
        s = state.standings[c]
        state.standings[c] = Standing(to, look.number, len(look.values.get(c, {})), s.mean,
                                      why.get(c))
    state.outcome = outcome


def _mean(values: dict[int, float]) -> float | None:
    return math.fsum(values.values()) / len(values) if values else None


def runs_saved(state: RaceState, race: RacePlan) -> int:
    """Runs of the full grid (conditions x max_seeds) the race has not needed so far."""
    top = schedule(race, len(state.seeds), len(state.conditions)).looks[-1]
    return len(state.conditions) * top - runs_taken(state, race)

"""Drive the race's decisions (retrain/campaign/race.py, no runs, no processes) over simulated
campaigns with known effects and noise, and print its error rates and run savings beside the
full grid's.

    python bench/campaign/race_sim.py [--campaigns 10000] [--seed 48]
    python bench/campaign/race_sim.py --interim-share 0.2,0.5,1 --seeds 5 \
        --scenario 2,0.15,0.1,0.1 [--scenario M,EFFECT,NOISE,LUCK ...]

A campaign has `m` conditions; condition 0 is better than the others by `effect` (0: all
equal), or, in a ladder, condition i is `i x effect` behind condition 0 (one close rival, the
rest further and further behind: where a race saves most). Run (c, s) scores mean_c + luck_s +
noise: luck_s ~ N(0, luck) is seed s's own luck, shared by every condition's run of that seed
(the same data order, sampling stream and init); noise is the run's own: normal with sd
`noise`, Student t with 3 degrees of freedom scaled to that sd (heavy tails), or an accuracy
over 64 held-out problems (binomial, bounded; the seed's luck moves its rate). The race (min 3,
max 10 seeds, rounds of 1, confidence 0.95) decides look by look; the full grid runs all 10
seeds of every condition and decides once, with the same intervals at the same confidence (a
race of one look). `--seeds` and `--min-seeds` change the 10 and the 3, `--interim-share` the
share of alpha the race's looks before the last spend (one row per share), `--scenario` replaces
the scenarios with your own (normal noise: conditions, effect, noise, luck).

Columns, over the campaigns (error rates with their 95% Clopper-Pearson upper bound):
  false elim.   the truly best condition eliminated (effect > 0)
  false verdict a winner or an elimination when all are equal (effect 0), or an "equivalent"
                between conditions that differ by more than the margin
  found         the truly best declared the winner beyond doubt (race / grid)
  picked        the truly best is the winner, or the best mean of those left (race / grid)
  runs          the race's runs as a share of the grid's
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from retrain.campaign.race import RaceState, decide, new_race, wanted  # noqa: E402
from retrain.campaign.race_plan import RacePlan  # noqa: E402

SEEDS = 10
PROBLEMS = 64  # an accuracy's held-out problems
SHARE = RacePlan.interim_share


@dataclass(frozen=True)
class Design:
    """The race simulated against the full grid: its seeds and how it spends alpha."""

    seeds: int = SEEDS
    min_seeds: int = 3
    share: float = SHARE

    def plans(self, margin: float) -> tuple[RacePlan, RacePlan]:
        race = RacePlan(min_seeds=self.min_seeds, max_seeds=self.seeds, round_seeds=1,
                        confidence=0.95, margin=margin, interim_share=self.share)
        grid = RacePlan(min_seeds=self.seeds, max_seeds=self.seeds, confidence=0.95,
                        margin=margin)
        return race, grid


@dataclass(frozen=True)
class Scenario:
    m: int                 # conditions
    effect: float          # how much better condition 0 is
    noise: float = 1.0     # a run's own noise (sd)
    luck: float = 1.0      # a seed's luck, shared by its runs (sd)
    kind: str = "normal"   # normal | t3 | accuracy
    margin: float = 0.0
    ladder: bool = False   # condition i is i x effect behind condition 0

    def mean(self, c: int) -> float:
        if self.ladder:
            return -c * self.effect
        return self.effect if c == 0 else 0.0

    def label(self) -> str:
        extra = f", margin {self.margin:g}" if self.margin else ""
        shape = "ladder of steps" if self.ladder else "effect"
        return f"{self.m} conditions, {shape} {self.effect:g}, noise {self.noise:g} " \
               f"({self.kind}), luck {self.luck:g}{extra}"


SCENARIOS = [
    *(Scenario(2, e, n) for n in (0.5, 1.0) for e in (0.0, 0.5, 1.0, 2.0)),
    Scenario(2, 8.0, 1.0),
    *(Scenario(6, e, 1.0) for e in (0.0, 1.0, 2.0, 4.0)),
    *(Scenario(6, e, 1.0, ladder=True) for e in (0.5, 1.0, 2.0)),
    Scenario(6, 0.0, 1.0, kind="t3"), Scenario(6, 2.0, 1.0, kind="t3"),
    Scenario(4, 0.0, 0.0, 0.05, kind="accuracy"), Scenario(4, 0.1, 0.0, 0.05, kind="accuracy"),
    Scenario(2, 0.0, 1.0, margin=1.0), Scenario(2, 1.5, 1.0, margin=1.0),
]


def campaign(sc: Scenario, rng: random.Random, seeds: int = SEEDS) -> dict[str, dict[int, float]]:
    """Every run's figure: {condition: {seed: value}}."""
    luck = {s: rng.gauss(0, sc.luck) for s in range(1, seeds + 1)}
    out = {}
    for c in range(sc.m):
        out[f"c{c}"] = {s: _score(sc, sc.mean(c), luck[s], rng) for s in luck}
    return out


def _score(sc: Scenario, mean: float, luck: float, rng: random.Random) -> float:
    if sc.kind == "accuracy":  # a base accuracy of 0.6 moved by the effect and the seed's luck
        p = min(1.0, max(0.0, 0.6 + mean + luck))
        return sum(rng.random() < p for _ in range(PROBLEMS)) / PROBLEMS
    if sc.kind == "t3":  # Student t, 3 df, scaled to sd `noise` (its sd is sqrt(3))
        z = rng.gauss(0, 1) / math.sqrt(rng.gammavariate(1.5, 2.0) / 3)
        return mean + luck + sc.noise * z / math.sqrt(3)
    return mean + luck + rng.gauss(0, sc.noise)


def race(plan: RacePlan, values: dict[str, dict[int, float]],
         resolution: float = 0.0) -> tuple[RaceState, int]:
    """The race over these figures (on a grid of step `resolution`), and the runs it took."""
    state = new_race(list(values), sorted(next(iter(values.values()))))
    taken = set()
    while state.outcome == "racing":
        want = wanted(state, plan)
        taken |= {(c, s) for c, seeds in want.items() for s in seeds}
        state = decide(state, plan, {c: {s: values[c][s] for s in want[c]}
                                     for c in state.racing()}, resolution)
    return state, len(taken)


@dataclass
class Tally:
    n: int = 0
    false_elim: int = 0
    false_verdict: int = 0
    found: int = 0
    picked: int = 0
    runs: int = 0

    def add(self, state: RaceState, runs: int, sc: Scenario) -> None:
        s = state.standings
        self.n += 1
        self.runs += runs
        best = s["c0"]
        if sc.effect > 0:
            self.false_elim += best.state == "eliminated"
            self.found += best.state == "winner"
            self.picked += _pick(state) == "c0"
        else:
            self.false_verdict += any(x.state in ("eliminated", "winner") for x in s.values())
        if sc.margin and sc.effect > sc.margin:
            self.false_verdict += state.outcome == "equivalent"


def _pick(state: RaceState) -> str:
    """The winner, else the best mean among the conditions not eliminated."""
    left = [c for c, x in state.standings.items() if x.state != "eliminated"]
    return max(left, key=lambda c: state.standings[c].mean)


def upper(k: int, n: int, level: float = 0.95) -> float:
    """Clopper-Pearson one-sided upper bound of a rate seen k times in n."""
    if k >= n:
        return 1.0
    from scipy.stats import beta

    return float(beta.ppf(level, k + 1, n - k))


def simulate(sc: Scenario, campaigns: int, seed: int, floor: bool = True,
             design: Design = Design()) -> tuple[Tally, Tally]:
    rng = random.Random(f"{seed}:{sc}")
    # an accuracy over 64 problems lies on a grid of 1/64: the race's variance floor
    resolution = 1 / PROBLEMS if sc.kind == "accuracy" and floor else 0.0
    raced, grid = Tally(), Tally()
    plans = design.plans(sc.margin)
    for _ in range(campaigns):
        values = campaign(sc, rng, design.seeds)
        for tally, plan in zip((raced, grid), plans, strict=True):
            tally.add(*race(plan, values, resolution), sc)
    return raced, grid


def _rate(k: int, n: int) -> str:
    return f"{k / n:.4f} (<= {upper(k, n):.4f})"


def row(sc: Scenario, raced: Tally, grid: Tally, design: Design | None = None) -> str:
    """The scenario's row; `design`: name the race's seeds and interim share in the row."""
    n = raced.n
    err = _rate(raced.false_elim, n) if sc.effect > 0 else "-"
    verdict = _rate(raced.false_verdict, n) if (sc.effect == 0 or sc.margin) else "-"
    found = f"{raced.found / n:.3f} / {grid.found / n:.3f}" if sc.effect > 0 else "-"
    picked = f"{raced.picked / n:.3f} / {grid.picked / n:.3f}" if sc.effect > 0 else "-"
    taken = raced.runs / grid.runs
    label = sc.label() + (f"; {design.min_seeds}-{design.seeds} seeds, interim share "
                          f"{design.share:g}" if design else "")
    return f"| {label} | {err} | {verdict} | {found} | {picked} | {taken:.1%} |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--campaigns", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=48)
    ap.add_argument("--kind", choices=("normal", "t3", "accuracy"), default=None,
                    help="only the scenarios of this noise kind")
    ap.add_argument("--no-floor", action="store_true",
                    help="no variance floor for accuracies (a difference without spread is no "
                         "interval), as before issue 53")
    ap.add_argument("--seeds", type=int, default=SEEDS, help="the most seeds (the grid's)")
    ap.add_argument("--min-seeds", type=int, default=3)
    ap.add_argument("--interim-share", default=f"{SHARE:g}",
                    help="comma-separated shares of alpha the looks before the last spend")
    ap.add_argument("--scenario", action="append", default=[], metavar="M,EFFECT,NOISE,LUCK",
                    help="your own scenario (normal noise), repeatable: replaces the built-in")
    args = ap.parse_args(argv)
    shares = [float(x) for x in args.interim_share.split(",")]
    own = [Scenario(int(m), float(e), float(n), float(k))
           for m, e, n, k in (x.split(",") for x in args.scenario)]
    named = len(shares) > 1 or shares != [SHARE] or args.seeds != SEEDS
    print(f"{args.campaigns} campaigns per scenario; race: min {args.min_seeds}, max "
          f"{args.seeds} seeds, rounds of 1, confidence 0.95, interim share "
          f"{args.interim_share}; grid: {args.seeds} seeds, one look\n")
    print("| scenario | false elim. (race) | false verdict (race) | found race / grid | "
          "picked race / grid | runs (race / grid) |")
    print("|---|---|---|---|---|---|")
    for sc in own or SCENARIOS:
        if args.kind not in (None, sc.kind):
            continue
        for share in shares:
            design = Design(args.seeds, args.min_seeds, share)
            print(row(sc, *simulate(sc, args.campaigns, args.seed, not args.no_floor, design),
                      design if named else None), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

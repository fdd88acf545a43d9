"""Each candidate against the baseline over every family at once (issue 56 item 4): the races of
bench/recipe/race.py decide per family; a default must hold on all of them, so this pools the
paired gains of every (family, seed) that both the candidate and the baseline ran.

    .venv/bin/python -m bench.recipe.pool /tmp/race/add2 /tmp/race/sub1 /tmp/race/rg [--baseline qv]

Each argument is a race's folder (its --out): its runs are OUT/logs/<family>/<condition>_s<seed>,
and only completed ones count. A condition run in several folders of one family must agree: the
runs are deterministic, so two different gains for one (family, condition, seed) is an error.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.recipe.measure import gain
from retrain.results.run_rows import read_rows
from retrain.results.stats import paired_interval
from retrain.runfiles import runlog

RUN = re.compile(r"^(?P<condition>.+)_s(?P<seed>\d+)$")


@dataclass(frozen=True)
class Pairs:
    """A candidate's gains and the baseline's, paired by (family, seed)."""

    condition: str
    keys: tuple[tuple[str, int], ...]
    gains: tuple[float, ...]
    baseline: tuple[float, ...]

    def families(self) -> list[str]:
        return sorted({family for family, _ in self.keys})

    def of(self, family: str) -> Pairs:
        pick = [i for i, (f, _) in enumerate(self.keys) if f == family]
        return Pairs(self.condition, tuple(self.keys[i] for i in pick),
                     tuple(self.gains[i] for i in pick), tuple(self.baseline[i] for i in pick))


def completed_gains(folders: list[Path]) -> dict[tuple[str, str], dict[int, float]]:
    """{(family, condition): {seed: gain of mean@k}} over the completed runs of the folders."""
    found: dict[tuple[str, str], dict[int, float]] = {}
    for folder in folders:
        logs = folder / "logs"
        if not logs.is_dir():
            raise SystemExit(f"{folder}: no logs/ folder: give the --out of a bench.recipe.race")
        for run in sorted(p for p in logs.glob("*/*") if p.is_dir()):
            match = RUN.match(run.name)
            state = runlog.load_state(run)
            if not match or state is None or state.status != "completed":
                continue
            key = (run.parent.name, match["condition"])
            seed, value = int(match["seed"]), gain(read_rows(run))["gain"]
            seen = found.setdefault(key, {})
            if seed in seen and seen[seed] != value:
                raise SystemExit(f"{run}: gain {value:+.4f}, but another folder has "
                                 f"{seen[seed]:+.4f} for {key[1]} seed {seed} on {key[0]}")
            seen[seed] = value
    return found


def pair_up(found: dict[tuple[str, str], dict[int, float]], baseline: str) -> list[Pairs]:
    """Every condition but the baseline, with the (family, seed) pairs it shares with it."""
    out = []
    for condition in sorted({c for _, c in found if c != baseline}):
        keys = sorted((family, seed) for (family, c), seeds in found.items() if c == condition
                      for seed in seeds if seed in found.get((family, baseline), {}))
        if keys:
            out.append(Pairs(condition, tuple(keys),
                             tuple(found[(f, condition)][s] for f, s in keys),
                             tuple(found[(f, baseline)][s] for f, s in keys)))
    return out


def interval(pairs: Pairs) -> str:
    """The mean paired difference in points and its 95% t interval ('-' under 2 pairs)."""
    if len(pairs.keys) < 2:
        return "-"
    diff, lo, hi = paired_interval(list(pairs.gains), list(pairs.baseline))
    return f"{100 * diff:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def table(all_pairs: list[Pairs], baseline: str) -> list[str]:
    families = sorted({f for p in all_pairs for f in p.families()})
    lines = [f"| condition | {' | '.join(families)} | all pairs | pairs | ahead |",
             "|---|" + "---|" * (len(families) + 3)]
    for p in all_pairs:
        cells = [interval(p.of(f)) if f in p.families() else "" for f in families]
        ahead = sum(g > b for g, b in zip(p.gains, p.baseline, strict=True))
        lines.append(f"| `{p.condition}` | {' | '.join(cells)} | {interval(p)} | "
                     f"{len(p.keys)} | {ahead}/{len(p.keys)} |")
    return lines + ["", f"Paired difference of the gain of mean@k to `{baseline}`, points, "
                        "mean [95% paired t interval]; 'ahead': pairs where the condition "
                        "gained more."]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path, help="the --out folders of races")
    ap.add_argument("--baseline", default="qv")
    args = ap.parse_args(argv)
    all_pairs = pair_up(completed_gains(args.folders), args.baseline)
    if not all_pairs:
        raise SystemExit(f"no condition shares a completed seed with {args.baseline!r} in "
                         f"{', '.join(map(str, args.folders))}")
    print("\n".join(table(all_pairs, args.baseline)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

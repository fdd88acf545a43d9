"""Race candidate defaults on one task family with `[campaign.race]` (issue 56 item 3): the
family's run (bench/recipe/families.py) is the campaign's base, each candidate a condition,
the seeds paired, held-out mean@4 after the last step the race's metric.

    .venv/bin/python -m bench.recipe.race --family sub1 --conditions qv,all_linear \\
        --seeds 1,2,3,4,5 --out /tmp/race-sub1 [--min-seeds 3] [--workers 2] [--tiny]

A condition is a candidate of CANDIDATES or several joined by '+' (all_linear+t1). The first
condition is the baseline of the paired differences. Running the same command again resumes the
race; OUT/race_table.md gets the decided table: per condition its state in the race, the gain of
mean@4 per seed (after - before), the mean gain and its 95% lower end, the seeds that learn, the
paired difference to the baseline, the median step seconds, the training's share of a step
(what a candidate that changes the training's work costs, read within each run), and the runs
the race took.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.campaign.algorithms_race import race_and_report
from bench.recipe.families import FAMILIES, family_run
from bench.recipe.measure import gain
from retrain.config import loader, toml_io
from retrain.config import sections as config
from retrain.config.overrides import parse_set_args
from retrain.config.sections import ALL_LINEAR
from retrain.results.race_view import race_lines
from retrain.results.run_rows import read_rows
from retrain.results.stats import estimate, paired

# The knobs the evidence names (issue 56 item 3), each as the overrides that make it.
CANDIDATES: dict[str, dict[str, object]] = {
    "qv": {},                                           # today's default: LoRA on q and v
    # on SmolLM2 the same adapter, init included, as listing its q, k, v, o, gate, up and
    # down projections (checked by hand on 2026-12-07; the races of that day listed them)
    "all_linear": {"model.lora_target_modules": [ALL_LINEAR]},
    "rank1": {"model.lora_rank": 1},
    "rank32": {"model.lora_rank": 32},
    "lr_half": {"training.lr": "x0.5"},                 # relative to the family's own lr
    "lr_double": {"training.lr": "x2"},
    "group16": {"training.batch_size": 2, "training.group_size": 16},   # same 32 completions
    "t1": {"training.temperature": 1.0},
    "t07": {"training.temperature": 0.7},
    "seq_mean": {"algorithm.loss_aggregation": "sequence_mean"},
    # The algorithms template's leader on two-digit additions (issue 48): PPO's clip [0.8, 1.2]
    # over 2 passes x 2 mini-batches, 4 optimizer steps per sampled batch.
    "ppo_2x2": {"algorithm.loss": "ppo", "algorithm.clip_eps": 0.2,
                "algorithm.clip_eps_high": 0.2, "training.epochs": 2,
                "training.mini_batches": 2},
    # ppo_2x2 without its second pass: two optimizer steps a batch, not four (ppo_2x2 doubles the
    # training's compute): the same forward and backward work as today's one update
    "ppo_1x2": {"algorithm.loss": "ppo", "algorithm.clip_eps": 0.2,
                "algorithm.clip_eps_high": 0.2, "training.mini_batches": 2},
    # clip-higher only acts once the ratio moves (epochs x mini-batches > 1, off-policy
    # samples): at one update per step it makes importance_sampling's update
    # (docs/algorithms.md), so race it as ppo_2x2+clip_higher (the later candidate's clip wins)
    "clip_higher": {"algorithm.loss": "ppo", "algorithm.clip_eps": 0.2,
                    "algorithm.clip_eps_high": 0.28},
}
TINY = ["model.name=tiny-random", "model.dtype=float32", "training.max_steps=2",
        "training.max_tokens=12", "data.eval_size=4"]


def condition(name: str, base: dict) -> dict:
    """The [[campaign.conditions]] table of `name` (candidates joined by '+')."""
    table: dict[str, object] = {"name": name.replace("+", "_and_")}
    for part in name.split("+"):
        if part not in CANDIDATES:
            raise SystemExit(f"--conditions: no candidate {part!r}; known: "
                             f"{', '.join(CANDIDATES)}")
        for key, value in CANDIDATES[part].items():
            if isinstance(value, str) and value.startswith("x"):   # a factor of the base's
                section, field = key.split(".")
                value = float(value[1:]) * float(base[section][field])
            table[key] = value
    return table


def write_campaign(out: Path, family: str, conditions: list[str], seeds: list[int],
                   min_seeds: int, workers: int, tiny: bool) -> Path:
    """OUT/<family>.toml: the family's run, its eval, the conditions and the race (kept as is
    when it exists: the race resumes)."""
    path = out / f"{family}.toml"
    if path.exists():
        return path
    out.mkdir(parents=True, exist_ok=True)
    base, overrides = family_run(family)
    sets = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    raw = config.apply_overrides(loader.read_toml_file(base),
                                 parse_set_args(sets + (TINY if tiny else [])))
    training = raw.setdefault("training", {})
    training.pop("seed", None)
    # Every condition is scored at the base's temperature, so that a temperature candidate
    # changes how it trains, not the eval it is judged by.
    training["eval_temperature"] = training.get("temperature", config.TrainingConfig.temperature)
    raw["logging"] = {"log_dir": "logs"}
    raw["campaign"] = {"name": family, "seeds": seeds, "parallel": workers > 1,
                       "max_workers": workers, "stagger_seconds": 0, "max_retries": 1,
                       "race": {"metric": "eval_mean_at_k", "min_seeds": min_seeds,
                                "round_seeds": 1, "confidence": 0.95},
                       "conditions": [condition(c, raw) for c in conditions]}
    loader.parse(raw, str(path))  # a bad condition is one line now, not hours later
    path.write_text(toml_io.dumps(raw), encoding="utf-8")
    return path


def table(report: dict, camp: Path) -> list[str]:
    """The decided table, in markdown."""
    race = report.get("race") or {}
    standings = race.get("state", {}).get("standings", {})
    gains = {c["name"]: _gains(report, c["name"], camp) for c in report["conditions"]}
    first = report["conditions"][0]["name"]
    lines = [f"| condition | race | seeds | gain of mean@4 per seed (pts) | mean gain | "
             f"95% lower end | learn | paired vs {first} [95%] | median step (s) | "
             f"training's share |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in report["conditions"]:
        runs = gains[c["name"]]
        e = estimate([g["gain"] for g in runs.values()])
        low = "-" if e.lo is None else f"{100 * e.lo:+.1f}"
        steps = sorted(g["step_s"] for g in runs.values())
        per_seed = ", ".join(f"{100 * g['gain']:+.1f}" for g in runs.values())
        lines.append(
            f"| `{c['name']}` | {standings.get(c['name'], {}).get('state', '-')} | {len(runs)} | "
            f"{per_seed} | "
            f"{100 * (e.mean or 0):+.1f} | {low} | "
            f"{sum(g['learns'] for g in runs.values())}/{len(runs)} | "
            f"{_paired(runs, gains[first], c['name'], first)} | "
            f"{steps[len(steps) // 2] if steps else 0:.1f} | {_share(runs)} |")
    taken = race.get("runs", {})
    return lines + ["", f"runs: {taken.get('taken', '?')} of the full grid's "
                        f"{taken.get('full', '?')} ({taken.get('saved', '?')} saved); "
                        f"outcome: {race.get('outcome', '-')}", "", *race_lines(race)]


def _share(runs: dict[int, dict]) -> str:
    """The median over seeds of the training's share of a step that trained."""
    shares = sorted(g["train_share"] for g in runs.values() if g["train_share"] is not None)
    return f"{shares[len(shares) // 2]:.2f}" if shares else "-"


def _gains(report: dict, name: str, camp: Path) -> dict[int, dict]:
    runs = sorted((r for r in report["runs"] if r["condition"] == name
                   and r["state"] == "completed"), key=lambda r: r["seed"])
    return {r["seed"]: gain(read_rows(camp / r["name"])) for r in runs}


def _paired(runs: dict[int, dict], base: dict[int, dict], name: str, first: str) -> str:
    seeds = sorted(runs.keys() & base.keys())
    if name == first or len(seeds) < 2:
        return "-"
    d = paired("gain", [runs[s]["gain"] for s in seeds], [base[s]["gain"] for s in seeds],
               name, first, seeds=tuple(seeds))
    return f"{100 * d.diff:+.1f} [{100 * d.lo:+.1f}, {100 * d.hi:+.1f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", required=True, choices=sorted(FAMILIES))
    ap.add_argument("--conditions", default="qv,all_linear")
    ap.add_argument("--seeds", default="1,2,3,4,5")
    ap.add_argument("--min-seeds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True, help="the campaign's folder")
    ap.add_argument("--tiny", action="store_true", help="smoke test on the tiny model")
    args = ap.parse_args(argv)
    out = args.out.expanduser().resolve()
    path = write_campaign(out, args.family, args.conditions.split(","),
                          [int(s) for s in args.seeds.split(",")], args.min_seeds,
                          args.workers, args.tiny)
    return race_and_report(out, path, out / "logs" / args.family, table)


if __name__ == "__main__":
    sys.exit(main())

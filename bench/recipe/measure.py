"""The default recipe on each task family, seed by seed: the held-out gain of mean@4 over
20 steps, its mean and 95% lower end over the seeds, and the share of seeds that learn
(a gain beyond twice the standard error of the difference of the two evaluations).

    .venv/bin/python -m bench.recipe.measure --families add2,sub1,sub2 --seeds 1,2,3,4,5 \\
        --workers 2 --out /tmp/recipe [--set training.lr=2e-3 ...] [--write]

Each run is `python -m retrain` on templates/quickstart.toml (or the family's own config)
with the family's `--set` overrides and `model.threads = 1`; a finished run is not run
again (rerun the command to add seeds or families)."""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

from bench.recipe.families import ROOT, family_run
from retrain.results.stats import estimate


def _value(v: object) -> str:
    return json.dumps(v) if not isinstance(v, str) else v


def command(family: str, seed: int, out: Path, extra: list[str]) -> list[str]:
    config, overrides = family_run(family)
    sets = {**overrides, "training.seed": seed, "logging.log_dir": str(out),
            "logging.run_name": f"{family}-s{seed}"}
    argv = [sys.executable, "-m", "retrain", str(config)]
    for key, value in sets.items():
        argv += ["--set", f"{key}={_value(value)}"]
    for item in extra:
        argv += ["--set", item]
    return argv


def run(family: str, seed: int, out: Path, extra: list[str]) -> dict:
    run_dir = out / f"{family}-s{seed}"
    if not _rows(run_dir) or _rows(run_dir)[-1].get("eval_mean_at_k") is None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        log = out / f"{family}-s{seed}.log"
        with open(log, "w") as fh:
            subprocess.run(command(family, seed, out, extra), cwd=out, env=env, stdout=fh,
                           stderr=subprocess.STDOUT, check=True)
    return gain(_rows(run_dir))


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def gain(rows: list[dict]) -> dict:
    first, last = rows[0], rows[-1]
    before, after = first["initial_eval_mean_at_k"], last["eval_mean_at_k"]
    se = math.hypot(first["initial_eval_mean_at_k_se"], last["eval_mean_at_k_se"])
    return {"before": before, "after": after, "gain": after - before,
            "learns": after - before > 2 * se,
            "step_s": sorted(r["step_time_s"] for r in rows)[len(rows) // 2],
            "train_share": train_share(rows)}


def train_share(rows: list[dict]) -> float | None:
    """The training's share of the steps that trained: what a candidate that changes the
    training's work costs, read within one run (the runs' step seconds move with the load the
    others put on the cores; both phases of a step move alike)."""
    trained = [r for r in rows if r.get("updates") and r.get("train_time_s") is not None]
    total = sum(r["step_time_s"] for r in trained)
    return sum(r["train_time_s"] for r in trained) / total if total > 0 else None


def table(results: dict[str, list[dict]]) -> str:
    out = ["| family | seeds | before (mean@4) | after | gain: mean | 95% lower end | "
           "learn | median step (s) |", "|---|---|---|---|---|---|---|---|"]
    for family, runs in results.items():
        e = estimate([r["gain"] for r in runs])
        mean, low = e.mean or 0.0, e.lo
        low_text = f"{100 * low:+.1f}" if low is not None else "-"
        out.append(f"| {family} | {len(runs)} | "
                   f"{sum(r['before'] for r in runs) / len(runs):.3f} | "
                   f"{sum(r['after'] for r in runs) / len(runs):.3f} | "
                   f"{100 * mean:+.1f} pts | {low_text} pts | "
                   f"{sum(r['learns'] for r in runs)}/{len(runs)} | "
                   f"{sorted(r['step_s'] for r in runs)[len(runs) // 2]:.1f} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", default="add2,sub1,sub2")
    p.add_argument("--seeds", default="1,2,3,4,5")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--set", dest="sets", action="append", default=[])
    p.add_argument("--write", action="store_true")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = [(f, int(s)) for f in args.families.split(",") for s in args.seeds.split(",")]
    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        done = list(pool.map(lambda j: run(*j, args.out.resolve(), args.sets), jobs))
    results: dict[str, list[dict]] = {}
    for (family, _), r in zip(jobs, done, strict=True):
        results.setdefault(family, []).append(r)
    text = table(results)
    print(text)
    if args.write:
        with open(ROOT / "bench" / "RESULTS.md", "a", encoding="utf-8") as fh:
            fh.write(f"\n### The default recipe by task family ({datetime.date.today()}, "
                     f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
                     f"\n\n`python -m bench.recipe.measure {' '.join(sys.argv[1:])}`\n\n"
                     f"{text}\n")


if __name__ == "__main__":
    main()

"""Race the algorithms template and write its decided table (issue 48 item 5).

    python -m bench.campaign.algorithms_race --out ~/algo-race           # as shipped: SmolLM2-135M
    python -m bench.campaign.algorithms_race --out ~/algo-race-2d --set data.digits=2   # harder
    python -m bench.campaign.algorithms_race --out /tmp/algo-smoke --tiny   # tiny model, 2 steps

Writes `retrain init --template algorithms` into --out with the --set overrides and --conditions
(a subset of the recipes) baked in, so that running the same command again resumes the same race
where it was. Then `retrain explain`, the campaign itself (its output streams through), and
`retrain compare --json`; prints, and writes to OUT/race_table.md, one row per recipe: its state
in the race, the seeds it ran, held-out accuracy before training (`initial_eval_accuracy`) and
after (each seed, and the mean with its 95% interval), the interval that decided it, and the
seconds per run (summed step_time_s), then the runs the race took against the full grid's.
Run it alone on the machine: the seconds are part of the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from retrain.cli import templates  # noqa: E402
from retrain.config import loader, toml_io  # noqa: E402
from retrain.config import sections as config  # noqa: E402
from retrain.config.overrides import parse_set_args  # noqa: E402
from retrain.results.race_view import race_lines  # noqa: E402
from retrain.results.run_rows import read_rows  # noqa: E402

RUN = subprocess.run   # how `retrain` is started (the tests start it warm)
TINY = ["model.name=tiny-random", "model.dtype=float32", "model.threads=1",
        "training.max_steps=2", "training.max_tokens=12", "data.eval_size=4",
        "reward.type=custom", "reward.function=digits.py:reward", "campaign.seeds=[1, 2]",
        "campaign.race.min_seeds=2", "campaign.stagger_seconds=0"]
DIGITS = '''def reward(completion, answer):
    """The fraction of digits: a reward the tiny model can earn."""
    return sum(c.isdigit() for c in completion) / len(completion) if completion else 0.0
'''


def write_campaign(out: Path, sets: list[str], conditions: list[str]) -> Path:
    """OUT/algorithms.toml: the template with `sets` and the chosen recipes (kept as is when it
    exists: the race resumes)."""
    path = out / "algorithms.toml"
    if path.exists():
        return path
    out.mkdir(parents=True, exist_ok=True)
    templates.write_template("algorithms", out / "template.toml")
    raw = config.apply_overrides(loader.read_toml_file(out / "template.toml"),
                                 parse_set_args(sets))
    if conditions:
        known = [c["name"] for c in raw["campaign"]["conditions"]]
        missing = sorted(set(conditions) - set(known))
        if missing:
            raise SystemExit(f"--conditions: no recipe {', '.join(missing)}; the template has "
                             f"{', '.join(known)}")
        raw["campaign"]["conditions"] = [c for c in raw["campaign"]["conditions"]
                                         if c["name"] in conditions]
    loader.parse(raw, str(path))  # a bad --set is one line now, not hours later
    path.write_text(toml_io.dumps(raw), encoding="utf-8")
    return path


def retrain(out: Path, *args: str, capture: bool = False) -> subprocess.CompletedProcess:
    done = RUN([sys.executable, "-m", "retrain", *args], cwd=out, text=True,
               capture_output=capture)
    if done.returncode != 0:
        raise SystemExit(f"retrain {' '.join(args)} exited {done.returncode}"
                         + (f": {done.stderr.strip()[-500:]}" if capture else ""))
    return done


def race_and_report(out: Path, path: Path, camp: Path,
                    table: Callable[[dict, Path], list[str]]) -> int:
    """Run the campaign file `path` in `out` (it resumes), then write `table` of its compare
    report to OUT/race_table.md and print it."""
    retrain(out, path.name)
    report = json.loads(retrain(out, "compare", str(camp), "--json", capture=True).stdout)
    text = "\n".join(table(report, camp)) + "\n"
    (out / "race_table.md").write_text(text, encoding="utf-8")
    print(f"\n{text}\n(written to {out / 'race_table.md'}; the campaign file: {path})")
    return 0


def table(report: dict, camp: Path) -> list[str]:
    """The decided table, in markdown."""
    race = report.get("race") or {}
    standings = race.get("state", {}).get("standings", {})
    lines = ["| recipe | race | seeds | held-out before | held-out after, per seed | mean [95%] "
             "| decided by | s / run |", "|---|---|---|---|---|---|---|---|"]
    for c in report["conditions"]:
        runs = sorted((r for r in report["runs"] if r["condition"] == c["name"]
                       and r["state"] == "completed"), key=lambda r: r["seed"])
        rows = {r["name"]: read_rows(camp / r["name"]) for r in runs}
        before = [_first(rows[r["name"]], "initial_eval_accuracy") for r in runs]
        seconds = [sum(x.get("step_time_s") or 0.0 for x in rows[r["name"]]) for r in runs]
        e = c["eval_accuracy"]
        s = standings.get(c["name"], {})
        why = s.get("why") or {}
        decided = (f"{why['diff']:+.3f} [{why['lo']:+.3f}, {why['hi']:+.3f}] vs {why['other']}"
                   if why else "-")
        per_run = f"{sum(seconds) / len(seconds):.0f}" if seconds else "-"
        lines.append(f"| `{c['name']}` | {s.get('state', '-')} | {len(runs)} | "
                     f"{_nums(before)} | {_nums([r['eval_accuracy'] for r in runs])} | "
                     f"{_estimate(e)} | {decided} | {per_run} |")
    taken = race.get("runs", {})
    lines += ["", f"runs: {taken.get('taken', '?')} of the full grid's "
                  f"{taken.get('full', '?')} ({taken.get('saved', '?')} saved); "
                  f"outcome: {race.get('outcome', '-')}", "", *race_lines(race)]
    return lines


def _first(rows: list[dict], key: str) -> float | None:
    return next((r[key] for r in rows if isinstance(r.get(key), (int, float))), None)


def _nums(values: list) -> str:
    return ", ".join("-" if v is None else f"{v:.3f}" for v in values) or "-"


def _estimate(e: dict) -> str:
    if e.get("mean") is None:
        return "-"
    if e.get("lo") is None:
        return f"{e['mean']:.3f}"
    return f"{e['mean']:.3f} [{e['lo']:.3f}, {e['hi']:.3f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the campaign's folder")
    ap.add_argument("--set", action="append", default=[], dest="sets",
                    help="section.key=value for the campaign file (repeatable)")
    ap.add_argument("--conditions", default="", help="comma-separated recipes (default: all)")
    ap.add_argument("--tiny", action="store_true", help="smoke test on the tiny model")
    args = ap.parse_args(argv)
    out = args.out.expanduser().resolve()
    conditions = [c for c in args.conditions.split(",") if c]
    if args.tiny:
        out.mkdir(parents=True, exist_ok=True)
        (out / "digits.py").write_text(DIGITS)
    path = write_campaign(out, (TINY if args.tiny else []) + args.sets, conditions)
    retrain(out, "explain", path.name)
    return race_and_report(out, path, out / "logs" / "algorithms", table)


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark the campaign runner's overhead per run.

    python bench/campaign/overhead.py            # 20 trivial runs, serial
    python bench/campaign/overhead.py --runs 40 --work-s 0.1

A trivial worker (a stdlib-only script that writes a completed state.json and one metrics
row, after sleeping --work-s) is run N times two ways: directly, one subprocess after the
other (the baseline: the sum of the runs), and as a serial campaign through
`run_campaign` with the local executor. Overhead per run = (campaign wall - baseline) / N:
matrix expansion, per-run config files, manifest writes, worker-log handling, polling.
A parallel campaign (max_workers = N, no stagger) is timed too.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from retrain.campaign.executor import LocalExecutor  # noqa: E402
from retrain.campaign.runner import run_campaign  # noqa: E402
from retrain.config.loader import load  # noqa: E402

WORKER = textwrap.dedent("""
    import json, os, sys, time, tomllib
    cfg = tomllib.loads(open(sys.argv[1]).read())
    run_dir = os.path.join(cfg["logging"]["log_dir"], cfg["logging"]["run_name"])
    os.makedirs(run_dir, exist_ok=True)
    time.sleep(float(os.environ.get("WORK_S", "0")))
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as fh:
        fh.write(json.dumps({"step": 1, "mean_reward": 0.0}) + "\\n")
    with open(os.path.join(run_dir, "state.json"), "w") as fh:
        json.dump({"status": "completed", "step": 1, "max_steps": 1}, fh)
""")

CAMPAIGN = """
[training]
max_steps = 1
[logging]
log_dir = "{log_dir}"
[campaign]
seeds = {seeds}
parallel = {parallel}
max_workers = 0
stagger_seconds = 0.0
"""


def campaign_wall(tmp: Path, worker: Path, runs: int, parallel: bool, tag: str) -> float:
    path = tmp / f"{tag}.toml"
    path.write_text(CAMPAIGN.format(log_dir=tmp / "logs", seeds=list(range(runs)),
                                    parallel=str(parallel).lower()))
    cfg, plan = load(path)
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = run_campaign(cfg, plan, path, executor=LocalExecutor([sys.executable, str(worker)]))
    wall = time.perf_counter() - t0
    assert code == 0, f"campaign failed with {code}"
    return wall


def baseline(tmp: Path, worker: Path, runs: int) -> float:
    """The same worker processes run back to back, each on a config of its own."""
    path = tmp / "baseline.toml"
    total = 0.0
    for i in range(runs):
        path.write_text(f'[logging]\nlog_dir = "{tmp / "base"}"\nrun_name = "r{i}"\n')
        t0 = time.perf_counter()
        subprocess.run([sys.executable, str(worker), str(path)], check=True)
        total += time.perf_counter() - t0
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--work-s", type=float, default=0.0, help="sleep inside each worker")
    args = ap.parse_args()
    os.environ["WORK_S"] = str(args.work_s)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        worker = tmp / "worker.py"
        worker.write_text(WORKER)
        base = baseline(tmp, worker, args.runs)
        serial = campaign_wall(tmp, worker, args.runs, parallel=False, tag="serial")
        parallel = campaign_wall(tmp, worker, args.runs, parallel=True, tag="parallel")
    n = args.runs
    print(f"{n} trivial runs (worker sleeps {args.work_s}s):")
    print(f"  baseline, processes back to back: {base:.2f}s ({1000 * base / n:.1f} ms/run)")
    print(f"  serial campaign:                  {serial:.2f}s ({1000 * serial / n:.1f} ms/run)")
    print(f"  runner overhead per run (serial): {1000 * (serial - base) / n:.1f} ms")
    print(f"  parallel campaign, all at once:   {parallel:.2f}s")


if __name__ == "__main__":
    main()

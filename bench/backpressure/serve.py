"""Back-pressure in a 4-worker campaign against `retrain serve`: fixed batch 8 vs
objective = throughput vs objective = goodput, where concurrent clients share one server.

    PYTHONPATH=$PWD python bench/backpressure/serve.py [--steps 30] [--out bench-out/bp-serve]

One real `retrain serve --model tiny-random` process; per arm, the real `retrain` CLI runs a
campaign of 4 seeds with `parallel = true, max_workers = 4` and backend = "tinker" against it,
so the four runs' requests contend for the server's two cores. The arms run one after the
other against the same server (the order is the same each time: fixed, throughput, goodput).
The task is the tiny model's learnable one from bench/serve/tinker_overlap.py (share of digit
characters: the tiny random model cannot do arithmetic), with the quickstart's shape
(batch 8 x group 8) and 10 tokens per completion.

Prints, per arm: campaign wall time, completions and tokens per second over all four runs,
mean reward of the first and last 5 steps (over the runs), and each run's batch sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.serve.tinker_overlap import REWARD, Serve  # noqa: E402

BASE = """
[model]
name = "tiny-random"
lora_rank = 8

[data]
source = "arithmetic"
size = 2000
eval_size = 0

[reward]
type = "custom"
function = "reward.py:digits"

[training]
batch_size = 8
group_size = 8
max_tokens = 10
max_steps = {steps}
lr = 0.01
save_every = 0

[backend]
backend = "tinker"
base_url = "{url}"
request_timeout_s = 300

[logging]
log_dir = "logs"

[campaign]
name = "{name}"
seeds = [1, 2, 3, 4]
parallel = true
max_workers = 4
stagger_seconds = 1.0
"""

BP = """
[backpressure]
enabled = true
warmup_steps = 4
min_batch_size = 1
max_batch_size = 32
objective = "{objective}"
"""

ARMS = {"fixed-8": None, "bp-throughput": "throughput", "bp-goodput": "goodput"}


def run_arm(folder: Path, name: str, objective: str | None, url: str, steps: int,
            env: dict) -> dict:
    text = BASE.format(steps=steps, url=url, name=name)
    if objective:
        text += BP.format(objective=objective)
    path = folder / f"{name}.toml"
    path.write_text(text)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "retrain", str(path)], env=env, cwd=folder,
                          capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed: {proc.stderr[-3000:]}")
    runs = {}
    for metrics in sorted((folder / "logs" / name).glob("*/metrics.jsonl")):
        runs[metrics.parent.name] = [json.loads(line) for line in
                                     metrics.read_text().splitlines() if line.strip()]
    return summary(wall, runs)


def summary(wall: float, runs: dict[str, list[dict]]) -> dict:
    rows = [r for rs in runs.values() for r in rs]
    tokens = sum(r["tokens_per_second"] * r["step_time_s"] for r in rows)
    return {"wall_s": wall,
            "completions": sum(r["num_completions"] for r in rows),
            "completions_per_s": sum(r["num_completions"] for r in rows) / wall,
            "tokens_per_s": tokens / wall,
            "median_step_time_s": statistics.median(r["step_time_s"] for r in rows),
            "reward_first5": statistics.mean(r["mean_reward"] for rs in runs.values()
                                             for r in rs[:5]),
            "reward_last5": statistics.mean(r["mean_reward"] for rs in runs.values()
                                            for r in rs[-5:]),
            "batch_sizes": {name: [r["batch_size"] for r in rs] for name, rs in runs.items()},
            "regimes": {name: [r.get("bp_regime") for r in rs] for name, rs in runs.items()},
            "api_wait_s": sum(r.get("api_wait_s", 0.0) for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="bench-out/bp-serve")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "reward.py").write_text(REWARD)
    env = {**os.environ, "TINKER_API_KEY": "tml-bench", "TINKER_TELEMETRY": "0",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    serve = Serve(0.0, env)
    results = {}
    try:
        for name, objective in ARMS.items():
            results[name] = run_arm(out, f"{name}-{time.strftime('%H%M%S')}", objective,
                                    serve.url, args.steps, env)
            print(name, json.dumps({k: v for k, v in results[name].items()
                                    if k not in ("batch_sizes", "regimes")}), flush=True)
    finally:
        serve.close()
    (out / "summary.json").write_text(json.dumps(results, indent=1))
    for name, s in results.items():
        print(f"\n## {name}\n" + "\n".join(f"{k}: {v}" for k, v in s.items()))


if __name__ == "__main__":
    main()

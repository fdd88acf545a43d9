"""Campaign API concurrency: `max_concurrent = "auto"` against fixed caps, on an endpoint with a
known capacity curve.

    PYTHONPATH=$PWD python bench/concurrency/campaign.py [--model peak12|peak3] [--steps 12]
        [--rounds 1] [--caps auto,2,4,8,12,16,32] [--out bench-out/concurrency]

One real `retrain serve --model tiny-random --load-model ...` process per load model; per
setting, the real `retrain` CLI runs a fresh campaign of 8 seeds (`parallel = true`,
`max_workers = 8`, backend = "tinker") against it. Settings are interleaved: each round runs
every cap once, the order rotated by one each round.

Load models (with N calls in flight a call waits B*(1 + S*(N-1) + K*N*(N-1)) ms on top of the
real work, 502 while more than F others are in flight):
- peak12: B=300, S=0, K=1/144 (p* = 12; the USL curve is flat from 9 to 16), F=24;
- peak3: B=150, S=0.1, K=0.1 (p* = 3, retrograde above it), F=8.

Per campaign: throughput = completions of every run / the steps' wall time (first step start
to last step end, over all runs; the workers' start-up is left out, it is the same for every
setting); also the campaign's whole wall time, the 502s the server answered, and for auto the
caps it chose (logs/<campaign>/concurrency.jsonl).
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

from bench.serve.tinker_overlap import REWARD  # noqa: E402

MODELS = {"peak12": "base_ms=300,sigma=0,kappa=0.006944,fail_above=24",
          "peak3": "base_ms=150,sigma=0.1,kappa=0.1,fail_above=8"}

CONFIG = """
[model]
name = "tiny-random"
threads = 1

[data]
source = "arithmetic"
size = 2000
eval_size = 0

[reward]
type = "custom"
function = "reward.py:digits"

[training]
batch_size = 8
group_size = 4
max_tokens = 6
max_steps = {steps}
lr = 0.01
save_every = 0

[backend]
backend = "tinker"
base_url = "{url}"
request_timeout_s = 300
max_concurrent = {cap}
max_concurrent_min = 1
max_concurrent_max = 64

[logging]
log_dir = "logs"

[campaign]
name = "{name}"
seeds = [1, 2, 3, 4, 5, 6, 7, 8]
parallel = true
max_workers = 8
stagger_seconds = 0
"""


class LoadServe:
    """`retrain serve --load-model` in a subprocess on a free port; its stderr to a file."""

    def __init__(self, load: str, env: dict, log: Path):
        self.log = log
        cmd = [sys.executable, "-m", "retrain", "serve", "--model", "tiny-random", "--port",
               "0", "--dtype", "float32", "--load-model", load]
        with open(log, "w") as err:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, env=env, stderr=err, text=True)
        deadline = time.monotonic() + 300
        self.url = ""
        while time.monotonic() < deadline and not self.url:
            for line in log.read_text().splitlines():
                if line.startswith("retrain serve: http://"):
                    self.url = line.split()[2]
            if self.proc.poll() is not None:
                raise RuntimeError("retrain serve exited before it was up")
            time.sleep(0.2)

    def count_502(self) -> int:
        return self.log.read_text().count("load model: 502")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def run_campaign(folder: Path, name: str, cap: str, url: str, steps: int, env: dict) -> dict:
    value = '"auto"' if cap == "auto" else cap
    path = folder / f"{name}.toml"
    path.write_text(CONFIG.format(steps=steps, url=url, cap=value, name=name))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "retrain", str(path)], env=env, cwd=folder,
                          capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed: {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
    camp = folder / "logs" / name
    rows = [json.loads(line) for m in sorted(camp.glob("*/metrics.jsonl"))
            for line in m.read_text().splitlines() if line.strip()]
    start = min(r["time"] - r["step_time_s"] for r in rows)
    end = max(r["time"] for r in rows)
    completions = sum(r["num_completions"] for r in rows)
    out = {"cap": cap, "campaign_wall_s": round(wall, 1), "steps_wall_s": round(end - start, 1),
           "completions": completions,
           "completions_per_s": round(completions / (end - start), 2)}
    decisions = camp / "concurrency.jsonl"
    if decisions.exists():
        caps = [json.loads(line)["cap"] for line in decisions.read_text().splitlines()]
        out["auto_caps"] = caps
        out["auto_final_cap"] = caps[-1] if caps else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="peak12")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--caps", default="auto,2,4,8,12,16,32")
    ap.add_argument("--out", default="bench-out/concurrency")
    args = ap.parse_args()
    out = Path(args.out).resolve() / args.model
    out.mkdir(parents=True, exist_ok=True)
    (out / "reward.py").write_text(REWARD)
    env = {**os.environ, "TINKER_API_KEY": "tml-bench", "TINKER_TELEMETRY": "0",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    caps = args.caps.split(",")
    serve = LoadServe(MODELS[args.model], env, out / "serve.log")
    results: dict[str, list[dict]] = {c: [] for c in caps}
    try:
        for k in range(args.rounds):
            order = caps[k % len(caps):] + caps[:k % len(caps)]
            for cap in order:
                before = serve.count_502()
                r = run_campaign(out, f"c{cap}-r{k}-{time.strftime('%H%M%S')}", cap,
                                 serve.url, args.steps, env)
                r["http_502"] = serve.count_502() - before
                results[cap].append(r)
                print(json.dumps(r), flush=True)
    finally:
        serve.close()
    (out / "summary.json").write_text(json.dumps(results, indent=1))
    print(f"\nload model {args.model}: {MODELS[args.model]}; {args.steps} steps x 8 runs")
    print(f"{'cap':>6s} {'completions/s':>14s} {'steps wall s':>13s} {'502s':>5s}")
    for cap, rs in results.items():
        print(f"{cap:>6s} {statistics.median(r['completions_per_s'] for r in rs):14.2f} "
              f"{statistics.median(r['steps_wall_s'] for r in rs):13.1f} "
              f"{sum(r['http_502'] for r in rs):5d}")


if __name__ == "__main__":
    main()

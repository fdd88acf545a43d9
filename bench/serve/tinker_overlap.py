"""Off-policy overlap through `retrain serve`: step wall time and learning, on-policy vs
`training.max_steps_off_policy = 1`, with 0, 100 and 300 ms added to every API request.

    PYTHONPATH=$PWD python bench/serve/tinker_overlap.py                  # 40 steps per run
    PYTHONPATH=$PWD python bench/serve/tinker_overlap.py --steps 12 --delays 300 --repeats 2

One real `retrain serve --model tiny-random --delay-ms D` process per delay; the real
`retrain` CLI trains against it with backend = "tinker". The two modes run one after the
other, in alternating order per repeat, so both see the same machine load. The run is the
quickstart's shape (4 prompts x 8 completions) on the tiny random model with a reward it can
learn (share of digit characters; the quickstart's `match` reward is always 0 for a random
model). Two times per run: the median `step_time_s` of steps 2.. (sample + reward + train; step 1
opens the session and has nothing to overlap with), and the median period between consecutive
metrics rows from step 3 on (the whole step, its checkpoint included: the wall time per step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REWARD = '''def digits(completion: str, answer: str) -> float:
    text = completion.strip()
    return sum(ch.isdigit() for ch in text) / max(1, len(text))
'''


def config(url: str, steps: int, off_policy: int, lr: float, loss: str) -> str:
    return f"""
[model]
name = "tiny-random"
lora_rank = 8

[data]
source = "arithmetic"
size = 400
eval_size = 0

[reward]
type = "custom"
function = "reward.py:digits"

[training]
seed = 1
batch_size = 4
group_size = 8
max_tokens = 10
max_steps = {steps}
lr = {lr}
save_every = 0
max_steps_off_policy = {off_policy}

[algorithm]
loss = "{loss}"

[backend]
backend = "tinker"
base_url = "{url}"
request_timeout_s = 120

[logging]
log_dir = "logs"
"""


class Serve:
    """`retrain serve` in a subprocess on a free port, with `delay_ms` added per request."""

    def __init__(self, delay_ms: float, env: dict):
        cmd = [sys.executable, "-m", "retrain", "serve", "--model", "tiny-random", "--port", "0",
               "--dtype", "float32", "--delay-ms", str(delay_ms)]
        self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        self.url = ""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError("retrain serve exited before it was up")
            if line.startswith("retrain serve: http://"):
                self.url = line.split()[2]
                break
        if not self.url:
            raise RuntimeError("retrain serve did not print its address")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def run_once(folder: Path, url: str, steps: int, off_policy: int, env: dict,
             lr: float = 0.03, loss: str = "importance_sampling") -> list[dict]:
    name = f"off{off_policy}-{time.monotonic_ns()}"
    (folder / "reward.py").write_text(REWARD)
    path = folder / f"{name}.toml"
    path.write_text(config(url, steps, off_policy, lr, loss))
    proc = subprocess.run([sys.executable, "-m", "retrain", "run", str(path)], env=env,
                          cwd=folder, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed: {proc.stderr[-2000:]}")
    lines = (folder / "logs" / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def summary(rows: list[dict]) -> dict:
    rewards = [r["mean_reward"] for r in rows]
    # the full period of a step, checkpoint included: time between consecutive rows
    periods = [b["time"] - a["time"] for a, b in zip(rows[1:], rows[2:], strict=False)]
    return {"period_s": statistics.median(periods),
            "step_time_s": statistics.median(r["step_time_s"] for r in rows[1:]),
            "sample_time_s": statistics.median(r["sample_time_s"] for r in rows[1:]),
            "train_time_s": statistics.median(r["train_time_s"] for r in rows[1:]),
            "reward_first5": statistics.mean(rewards[:5]),
            "reward_last10": statistics.mean(rewards[-10:]),
            "staleness": statistics.mean(r.get("sample_staleness", 0) for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--delays", default="0,100,300", help="ms added per request, comma list")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default="", help="write every run's rows here (JSON)")
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--loss", default="importance_sampling",
                    choices=("importance_sampling", "ppo"))
    args = ap.parse_args()
    env = {**os.environ, "TINKER_API_KEY": "tml-bench", "TINKER_TELEMETRY": "0",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for delay in [float(d) for d in args.delays.split(",")]:
            serve = Serve(delay, env)
            try:
                for rep in range(args.repeats):
                    for off in ((0, 1) if rep % 2 == 0 else (1, 0)):
                        rows = run_once(Path(tmp), serve.url, args.steps, off, env,
                                        args.lr, args.loss)
                        results.append({"delay_ms": delay, "off_policy": off, "repeat": rep,
                                        **summary(rows), "rows": rows})
                        print(json.dumps({k: v for k, v in results[-1].items() if k != "rows"}),
                              flush=True)
            finally:
                serve.close()
    print_table(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results))


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def print_table(results: list[dict]) -> None:
    print("\n| added per request | mode | wall time per step | speed-up | step_time_s "
          "| speed-up | sample_time_s | train_time_s | reward first 5 -> last 10 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for delay in sorted({r["delay_ms"] for r in results}):
        by_mode = {m: [r for r in results if r["delay_ms"] == delay and r["off_policy"] == m]
                   for m in (0, 1)}
        base = by_mode[0]
        for mode, runs in by_mode.items():
            if not runs:
                continue
            period, t = med(runs, "period_s"), med(runs, "step_time_s")
            up = f"{med(base, 'period_s') / period:.2f}x" if base else "-"
            speed = f"{med(base, 'step_time_s') / t:.2f}x" if base else "-"
            print(f"| {delay:g} ms | {'off-policy 1' if mode else 'on-policy'} | {period:.3f} "
                  f"| {up} | {t:.3f} | {speed} "
                  f"| {statistics.median(r['sample_time_s'] for r in runs):.3f} "
                  f"| {statistics.median(r['train_time_s'] for r in runs):.3f} "
                  f"| {statistics.mean(r['reward_first5'] for r in runs):.2f} -> "
                  f"{statistics.mean(r['reward_last10'] for r in runs):.2f} |")


if __name__ == "__main__":
    main()

"""Back-pressure on a real run: fixed batch 8 vs objective = throughput vs objective = goodput.

    python bench/backpressure/real.py [--out bench-out/bp-real] [--rounds 3] [--slice 240]
                                      [--arms fixed-8,bp-throughput,bp-goodput]

The quickstart task (SmolLM2-135M-Instruct, one-digit arithmetic, group_size 8, max_tokens
48) on the local CPU, three arms that differ only in [backpressure]. The arms are interleaved
so they share the machine's conditions: each round runs every arm for `--slice` seconds of
wall clock, then interrupts it (SIGINT: the step in flight finishes and is checkpointed); the
next round resumes it. An arm's time axis is its own training time (the sum of its steps'
`step_time_s` and `eval_time_s`), so waiting for the other arms is not counted.

Prints, per arm: steps, completions, median tokens/s, the batch-size trajectory, the mean
reward of the last 5 steps, the held-out greedy accuracy at each eval against training time;
and draws `retrain plot` for the goodput arm (else the throughput arm).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BASE = """
[model]
name = "smollm2-135m-instruct"
lora_rank = 8
threads = 2

[data]
source = "arithmetic"
digits = 1
operations = ["+", "*"]
eval_size = 32
instruction = "{instruction}"

[reward]
type = "match"

[training]
batch_size = 8
group_size = 8
max_tokens = 48
max_steps = 500
micro_batch_size = 8
eval_every = 5
lr = 1e-3
temperature = 0.7
seed = 42

[logging]
log_dir = "{log_dir}"
run_name = "{name}"
"""

BP = """
[backpressure]
enabled = true
warmup_steps = 4
min_batch_size = 1
max_batch_size = 16
objective = "{objective}"
"""

# The quickstart's instruction, as a TOML basic string (backslashes doubled).
INSTRUCTION = ("End your reply with the result written as \\\\boxed{result}, e.g. "
               "3 + 4 = 7, so \\\\boxed{7}.")
ARMS = {"fixed-8": None, "bp-throughput": "throughput", "bp-goodput": "goodput"}


def write_configs(out: Path, arms: list[str]) -> dict[str, Path]:
    paths = {}
    for name in arms:
        objective = ARMS[name]
        text = BASE.format(log_dir=out / "logs", name=name, instruction=INSTRUCTION)
        if objective:
            text += BP.format(objective=objective)
        paths[name] = out / f"{name}.toml"
        paths[name].write_text(text)
    return paths


def run_slice(config: Path, seconds: float) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "retrain", str(config)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)      # finish the step in flight, checkpoint, exit
        proc.wait()


def summary(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    clock, evals = 0.0, []
    if rows and "initial_eval_accuracy" in rows[0]:
        evals.append((0.0, rows[0]["initial_eval_accuracy"]))
    for r in rows:
        clock += r["step_time_s"] + r.get("eval_time_s", 0.0)
        if "eval_accuracy" in r:
            evals.append((clock, r["eval_accuracy"]))
    noise = [r.get("grad_noise_scale") for r in rows if r.get("grad_noise_scale") is not None]
    return {"steps": len(rows), "train_time_s": clock,
            "completions": sum(r["num_completions"] for r in rows),
            "median_tokens_per_s": statistics.median(r["tokens_per_second"] for r in rows),
            "tokens_per_s_overall": sum(r["tokens_per_second"] * r["step_time_s"] for r in rows)
            / max(sum(r["step_time_s"] for r in rows), 1e-9),
            "batch_sizes": [r["batch_size"] for r in rows],
            "lr": [round(r["lr"], 6) for r in rows],
            "reward_last5": statistics.fmean(r["mean_reward"] for r in rows[-5:]),
            "reward": [round(r["mean_reward"], 3) for r in rows],
            "evals": [(round(t), a) for t, a in evals],
            "grad_noise_scale_last": noise[-1] if noise else None,
            "grad_coherence": [r.get("grad_coherence") for r in rows],
            "grad_diagnostics_s_median": statistics.median(
                [r["grad_diagnostics_s"] for r in rows if r.get("grad_diagnostics_s")] or [0.0]),
            "train_time_s_median": statistics.median(r["train_time_s"] for r in rows),
            "bp_regimes": [r.get("bp_regime") for r in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench-out/bp-real")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--slice", type=float, default=240.0)
    ap.add_argument("--arms", default=",".join(ARMS),
                    help="comma-separated, of: " + ", ".join(ARMS))
    args = ap.parse_args()
    arms = args.arms.split(",")
    if unknown := [a for a in arms if a not in ARMS]:
        sys.exit(f"error: --arms: unknown arm(s) {unknown}; choose from {list(ARMS)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    configs = write_configs(out, arms)
    for k in range(args.rounds):
        for name, path in configs.items():
            t0 = time.time()
            run_slice(path, args.slice)
            print(f"round {k + 1} {name}: {time.time() - t0:.0f}s", flush=True)
    results = {name: summary(out / "logs" / name) for name in configs}
    (out / "summary.json").write_text(json.dumps(results, indent=1))
    for name, s in results.items():
        print(f"\n## {name}\n" + "\n".join(f"{k}: {v}" for k, v in s.items()))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    drawn = "bp-goodput" if "bp-goodput" in configs else "bp-throughput"
    if drawn in configs:
        subprocess.run([sys.executable, "-m", "retrain", "plot", str(out / "logs" / drawn)],
                       env=env, check=False)


if __name__ == "__main__":
    main()

"""One run on 1, 2, ... N ranks: steps/s and trained tokens/s against the number of ranks.

Each run is the same config started through torch's launcher (`python -m
torch.distributed.run --standalone --nproc-per-node N -m retrain run.toml`; N = 1 is the
plain one-process run), measured from its own metrics rows (warm-up steps left out). On a
CPU the ranks share the same cores one process uses (threads = 0: each rank takes its share),
so it shows the overhead of the messages and the all-reduce, not a speed-up; on a machine
with N GPUs each rank has its own device:

    .venv/bin/python -m bench.distributed --ranks 1,2                  # CPU, tiny model
    .venv/bin/python -m bench.distributed --model smollm2-135m-instruct --device cuda \\
        --dtype bfloat16 --ranks 1,2,4,8 --write

`--write` appends the table to bench/RESULTS.md with machine, date and command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REWARD = str(ROOT / "bench" / "_common.py") + ":dense_reward"


def config(args: argparse.Namespace) -> str:
    return f"""[model]
name = "{args.model}"
dtype = "{args.dtype}"
device = "{args.device}"
threads = 0
lora_rank = 8

[data]
source = "arithmetic"
eval_size = 0

[reward]
type = "custom"
function = "{REWARD}"

[training]
batch_size = {args.batch}
group_size = {args.group}
max_tokens = {args.max_tokens}
max_steps = {args.warmup + args.steps}
lr = 1e-4
seed = 1
save_every = {args.warmup + args.steps}

[logging]
log_dir = "logs"
"""


def run(ranks: int, args: argparse.Namespace) -> dict:
    """One run on `ranks` ranks; its figures after the warm-up steps."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "run.toml").write_text(config(args))
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", str(ranks)] if ranks > 1 else [sys.executable]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([*launcher, "-m", "retrain", "run.toml"], cwd=tmp, env=env,
                              capture_output=True, text=True, timeout=args.timeout)
        if done.returncode:
            raise SystemExit(f"{ranks} ranks failed:\n{done.stderr[-3000:]}")
        lines = (Path(tmp) / "logs" / "run" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines if x.strip()][args.warmup:]
    step = statistics.median(r["step_time_s"] for r in rows)
    trained = sum(r["trained_tokens"] for r in rows) / sum(r["step_time_s"] for r in rows)
    return {"ranks": ranks, "step_s": step, "steps_per_s": 1 / step, "trained_tok_s": trained,
            "world_size": rows[-1].get("world_size")}


def table(results: list[dict]) -> str:
    base = results[0]
    out = ["| ranks | median step (s) | steps/s | trained tok/s | vs 1 rank | per rank |",
           "|---|---|---|---|---|---|"]
    for r in results:
        speedup = r["trained_tok_s"] / base["trained_tok_s"]
        out.append(f"| {r['ranks']} | {r['step_s']:.3f} | {r['steps_per_s']:.2f} | "
                   f"{r['trained_tok_s']:.0f} | {speedup:.2f}x | "
                   f"{speedup / r['ranks'] * base['ranks']:.0%} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="1,2", help="comma-separated rank counts")
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--write", action="store_true")
    args = p.parse_args()
    results = [run(int(n), args) for n in args.ranks.split(",")]
    text = table(results)
    print(text)
    if args.write:
        command = "python -m bench.distributed " + " ".join(sys.argv[1:])
        with open(ROOT / "bench" / "RESULTS.md", "a", encoding="utf-8") as fh:
            fh.write(f"\n### One run on several ranks ({datetime.date.today()}, "
                     f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                     f"{args.model} {args.dtype} on {args.device})\n\n`{command}`\n\n"
                     f"{text}\n")


if __name__ == "__main__":
    main()

"""Side-by-side RL step time: retrain's local backend vs TRL's GRPOTrainer.

Same model, dtype, prompts, reward, LoRA and batch shape; no KL/reference model on either
side; one optimizer step per RL step. Each measurement runs in a fresh process (so peak
RSS is per tool), tools are interleaved ABAB... to cancel machine drift, warm-up steps are
excluded. From a fresh clone: `make bench` (setup, the `bench` extra, `--rounds 2`). Or, after
`make setup` and `pip install -e '.[bench]'`:

    .venv/bin/python -m bench.step_time --config smollm2 --rounds 2
    .venv/bin/python -m bench.step_time --config smollm2-fp32 --rounds 2   # no native bf16
    .venv/bin/python -m bench.step_time --config tiny --rounds 3 --write

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

from retrain.machine.cpu import cpu_has_native_bf16

ROOT = Path(__file__).resolve().parents[1]

SMOLLM2 = dict(model="smollm2-135m-instruct", dtype="bfloat16", batch=4, group=8, max_tokens=64,
               lora_rank=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lr=1e-5,
               warmup=1, steps=3)

CONFIGS = {
    # The workload of shared/notes/offline-models.md: 4 prompts x 8 completions x 64 tokens.
    "smollm2": SMOLLM2,
    # The same in float32, for CPUs without native bfloat16 (where bf16 is emulated and a
    # single step takes minutes on either tool: python -m bench.dtype_speed).
    "smollm2-fp32": {**SMOLLM2, "dtype": "float32"},
    "tiny": dict(model="tiny-random", dtype="float32", batch=4, group=8, max_tokens=64,
                 lora_rank=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lr=1e-4,
                 warmup=2, steps=8),
}


def run_one(tool: str, spec: dict, env: dict[str, str | None] | None = None,
            timeout: float | None = None) -> dict:
    """Run one measurement in a fresh process and return its parsed JSON line. `env`: variables
    to set for it (None: unset); `timeout`: seconds (subprocess.TimeoutExpired past them)."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{tool}-") as tmp:
        spec = {**spec, "out_dir": tmp}
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        worker = "bench._trl_worker" if tool == "trl" else "bench._retrain_worker"
        full = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
                **(env or {})}
        full = {k: v for k, v in full.items() if v is not None}
        proc = subprocess.run([sys.executable, "-m", worker, str(spec_path)], cwd=ROOT,
                              env=full, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise SystemExit(f"{tool} worker failed:\n{proc.stderr[-3000:]}")
        last = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
        return json.loads(last)


def summarize(results: list[dict]) -> dict:
    """Median step time and token rates over every measured step of every round."""
    steps = [s for r in results for s in r["steps"]]
    sample_tok = sum(s["completion_tokens"] for s in steps)
    train_tok = sum(s["total_tokens"] for s in steps)
    return {
        "median_step_s": statistics.median(s["step_time_s"] for s in steps),
        "median_sample_s": statistics.median(s["sample_time_s"] for s in steps),
        "median_train_s": statistics.median(s["train_time_s"] for s in steps),
        "sample_tok_s": sample_tok / sum(s["sample_time_s"] for s in steps),
        "train_tok_s": train_tok / sum(s["train_time_s"] for s in steps),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
        "n_steps": len(steps),
    }


def table(name: str, spec: dict, summary: dict[str, dict]) -> str:
    r, t = summary["retrain"], summary["trl"]
    rows = [
        ("median step time (s)", "median_step_s", "{:.2f}"),
        ("  of which sampling (s)", "median_sample_s", "{:.2f}"),
        ("  of which training (s)", "median_train_s", "{:.2f}"),
        ("sampling tokens/s", "sample_tok_s", "{:.0f}"),
        ("training tokens/s", "train_tok_s", "{:.0f}"),
        ("peak RSS (MiB)", "peak_rss_mb", "{:.0f}"),
        ("measured steps", "n_steps", "{}"),
    ]
    lines = [f"### {name}: {spec['model']} {spec['dtype']}, {spec['batch']} prompts x "
             f"{spec['group']} completions x {spec['max_tokens']} tokens, "
             f"LoRA r={spec['lora_rank']} {'/'.join(spec['target_modules'])}",
             "", "| | retrain | TRL | TRL / retrain |", "|---|---|---|---|"]
    for label, key, fmt in rows:
        ratio = t[key] / r[key] if r[key] else float("nan")
        if key in ("sample_tok_s", "train_tok_s"):
            ratio = r[key] / t[key] if t[key] else float("nan")  # higher is better: retrain / TRL
        ratio_s = "" if key == "n_steps" else f"{ratio:.2f}x"
        lines.append(f"| {label} | {fmt.format(r[key])} | {fmt.format(t[key])} | {ratio_s} |")
    lines.append("")
    lines.append("(token-rate rows show retrain / TRL, so > 1 means retrain is faster everywhere)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", choices=[*CONFIGS, "all"], default="all")
    ap.add_argument("--rounds", type=int, default=2, help="ABAB rounds (each tool once per round)")
    ap.add_argument("--steps", type=int, help="measured steps per process (after warm-up)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--trl-no-gradient-checkpointing", action="store_true",
                    help="TRL defaults to gradient checkpointing on; turn it off")
    ap.add_argument("--write", action="store_true", help="append the tables to bench/RESULTS.md")
    args = ap.parse_args()
    native = cpu_has_native_bf16()
    if args.config == "all":  # what this CPU runs in reasonable time
        names = [n for n in CONFIGS if n != ("smollm2" if not native else "smollm2-fp32")]
    else:
        names = [args.config]
    if not native and any(CONFIGS[n]["dtype"] == "bfloat16" for n in names):
        print("warning: this CPU has no native bfloat16: both tools run it emulated, "
              "minutes per step; --config smollm2-fp32 is the comparison that fits here",
              file=sys.stderr, flush=True)
    sections = []
    for name in names:
        spec = {**CONFIGS[name], "seed": 7, "threads": args.threads,
                "trl_gradient_checkpointing": not args.trl_no_gradient_checkpointing}
        if args.steps:
            spec["steps"] = args.steps
        results: dict[str, list] = {"retrain": [], "trl": []}
        for rnd in range(args.rounds):
            order = ("retrain", "trl") if rnd % 2 == 0 else ("trl", "retrain")
            for tool in order:
                res = run_one(tool, spec)
                results[tool].append(res)
                med = statistics.median(s["step_time_s"] for s in res["steps"])
                print(f"[{name}] round {rnd + 1} {tool}: median step {med:.2f}s, "
                      f"peak RSS {res['peak_rss_mb']:.0f} MiB", flush=True)
        summary = {tool: summarize(rs) for tool, rs in results.items()}
        sections.append(table(name, spec, summary))
        print("\n" + sections[-1] + "\n", flush=True)
    if args.write:
        header = (f"## {datetime.date.today().isoformat()} on {platform.node()} "
                  f"({os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
                  f"native bf16: {'yes' if native else 'no'}, "
                  f"Python {platform.python_version()})\n\n"
                  f"Command: `python -m bench.step_time {' '.join(sys.argv[1:])}`\n")
        with open(ROOT / "bench" / "RESULTS.md", "a") as fh:
            fh.write("\n" + header + "\n" + "\n\n".join(sections) + "\n")


if __name__ == "__main__":
    main()

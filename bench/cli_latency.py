"""Wall time of the light CLI paths: `retrain --help`, `explain <template>`, `explain` of an
SFT config of the tiny model (its rows counted with the model's tokenizer), `status <dir>`.

Each command runs as a fresh subprocess (`python -m retrain ...`, this checkout first on
PYTHONPATH) several times; the script prints the median and the minimum. Target: < 0.3 s.

    python bench/cli_latency.py [--repeat 10]

Numbers taken while other processes compete for the CPU are noisy; the minimum is the
better estimate of the cost itself.
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

REPO = Path(__file__).resolve().parents[1]
TARGET_S = 0.3


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _time(args: list[str], cwd: Path, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "retrain", *args], cwd=cwd, env=_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        times.append(time.perf_counter() - start)
        if proc.returncode != 0:
            raise SystemExit(f"retrain {' '.join(args)} failed: {proc.stderr.decode()[-500:]}")
    return times


def _synthetic_logs(root: Path) -> None:
    """A logs folder with a few finished runs, so `status` has real work to do."""
    for i in range(5):
        run = root / "logs" / f"run{i}"
        run.mkdir(parents=True)
        rows = [{"step": s, "mean_reward": 0.1 * s, "step_time_s": 1.0 + s % 3,
                 "tokens_per_second": 500.0, "max_token_hit_rate": 0.0} for s in range(1, 101)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / "state.json").write_text(json.dumps({"status": "completed", "step": 100,
                                                    "max_steps": 100}))


def _sft_config(root: Path) -> None:
    """sft.toml: an [sft] stage over 8 chat rows on `tiny-random`, built first (explain counts
    the rows with its tokenizer only when the model is on the machine)."""
    from retrain.backends.models import TINY, resolve_model

    resolve_model(TINY)
    rows = [{"messages": [{"role": "user", "content": f"{i} + {i}?"},
                          {"role": "assistant", "content": str(2 * i)}]} for i in range(8)]
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "sft.toml").write_text(f'[model]\nname = "{TINY}"\ndevice = "cpu"\n'
                                   '[sft]\nsteps = 2\n[sft.data]\npath = "chat.jsonl"\n')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        _synthetic_logs(cwd)
        _sft_config(cwd)
        subprocess.run([sys.executable, "-m", "retrain", "init", "quickstart.toml"], cwd=cwd,
                       env=_env(), check=True, stdout=subprocess.DEVNULL)
        _time(["--version"], cwd, 2)  # warm the OS file cache and the bytecode cache
        print(f"python {sys.version.split()[0]}, {args.repeat} runs each, target < {TARGET_S}s")
        print(f"{'command':32s} {'median':>8s} {'min':>8s}")
        for label, cmd in (("retrain --help", ["--help"]),
                           ("retrain explain quickstart.toml", ["explain", "quickstart.toml"]),
                           ("retrain explain sft.toml", ["explain", "sft.toml"]),
                           ("retrain status logs", ["status", "logs"])):
            t = _time(cmd, cwd, args.repeat)
            flag = "" if statistics.median(t) < TARGET_S else "  (over target)"
            print(f"{label:32s} {statistics.median(t):7.3f}s {min(t):7.3f}s{flag}")


if __name__ == "__main__":
    main()

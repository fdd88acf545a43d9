"""A quickstart-shaped step alone and beside one busy process, with OpenMP's default (spinning)
waits and with the passive waits `retrain` sets (issue 37, docs/training.md 'A busy machine').

Each measurement is a fresh process (bench/_retrain_worker.py) running warm-up + steps RL steps
of SmolLM2-135M in float32, 4 prompts x 8 completions of at most 48 tokens. "busy" starts
`python -c "while True: pass"` before the run and kills it after. Conditions are interleaved
round by round to cancel machine drift:

    .venv/bin/python -m bench.outside_load --rounds 2

Needs an otherwise quiet machine: it measures what one extra busy process costs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
from collections.abc import Iterator

from bench.step_time import SMOLLM2, run_one

SPEC = {**SMOLLM2, "dtype": "float32", "max_tokens": 48, "warmup": 1, "steps": 2, "seed": 7,
        "threads": 0}
POLICIES = {"default (spinning)": None, "PASSIVE (retrain's)": "PASSIVE"}


@contextlib.contextmanager
def busy_process(on: bool) -> Iterator[None]:
    """One process that keeps a core busy for as long as the block runs."""
    if not on:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def measure(policy: str | None, busy: bool) -> float:
    """The median step time of one fresh run."""
    with busy_process(busy):
        out = run_one("retrain", SPEC, env={"OMP_WAIT_POLICY": policy})
    return statistics.median(s["step_time_s"] for s in out["steps"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    times: dict[tuple[str, bool], list[float]] = {}
    for _ in range(args.rounds):
        for name, policy in POLICIES.items():
            for busy in (False, True):
                times.setdefault((name, busy), []).append(measure(policy, busy))
                print(json.dumps({"policy": name, "busy": busy,
                                  "step_time_s": times[(name, busy)][-1]}), flush=True)
    print("\n| OpenMP waits | alone: step s | beside one busy process: step s | slowdown |")
    print("|---|---|---|---|")
    for name in POLICIES:
        alone = statistics.median(times[(name, False)])
        busy = statistics.median(times[(name, True)])
        print(f"| {name} | {alone:.2f} | {busy:.2f} | {busy / alone:.2f}x |")


if __name__ == "__main__":
    main()

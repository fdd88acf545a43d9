"""A quickstart-shaped step alone and beside one busy process, under OpenMP wait settings:
libgomp's default (spin 300,000 times at a barrier, then sleep), passive waits (sleep at once:
what `retrain` set since issue 37), and short spin counts (GOMP_SPINCOUNT) in between (issue 47
item 15, docs/training.md 'A busy machine'), each with every core as its threads; and retrain's
default since then, `fitted`: libgomp's waits with the threads fitted to the cores other
processes leave free.

Each measurement is a fresh process (bench/_retrain_worker.py) running warm-up + steps RL steps
of SmolLM2-135M in float32, 4 prompts x 8 completions of at most 48 tokens. "busy" starts
`python -c "while True: pass"` before the run and kills it after. Conditions are interleaved
round by round to cancel machine drift:

    .venv/bin/python -m bench.outside_load --rounds 2
    .venv/bin/python -m bench.outside_load --rounds 2 --settings default passive spin-10k

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
from retrain.machine.cpu import available_cores

CORES = available_cores()
SPEC = {**SMOLLM2, "dtype": "float32", "max_tokens": 48, "warmup": 1, "steps": 2, "seed": 7}
# name -> (the environment a run gets: libgomp reads it when torch loads, [model] threads).
# threads = CORES is what `threads = 0` meant before fitted threads: every core, always.
SETTINGS = {
    "default": ({}, CORES),                                # spin 300,000 times, then sleep
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, CORES),    # sleep at once
    "spin-1k": ({"GOMP_SPINCOUNT": "1000"}, CORES),
    "spin-10k": ({"GOMP_SPINCOUNT": "10000"}, CORES),
    "spin-100k": ({"GOMP_SPINCOUNT": "100000"}, CORES),
    # retrain's default: libgomp's waits, the threads fitted to the cores others leave free
    # (backends/local/threads.py), chosen as the model loads and after every step
    "fitted": ({}, 0),
}


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


def measure(setting: tuple[dict[str, str], int], busy: bool) -> float:
    """The median step time of one fresh run (OpenMP variables not in its env unset)."""
    env, threads = setting
    with busy_process(busy):
        out = run_one("retrain", {**SPEC, "threads": threads},
                      env={"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None, **env})
    print(json.dumps({"threads_after_each_step": [s["cpu_threads"] for s in out["steps"]]}),
          flush=True)
    return statistics.median(s["step_time_s"] for s in out["steps"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    args = parser.parse_args()
    times: dict[tuple[str, bool], list[float]] = {}
    for _ in range(args.rounds):
        for name in args.settings:
            for busy in (False, True):
                times.setdefault((name, busy), []).append(measure(SETTINGS[name], busy))
                print(json.dumps({"setting": name, "busy": busy,
                                  "step_time_s": times[(name, busy)][-1]}), flush=True)
    best_alone = min(statistics.median(times[(n, False)]) for n in args.settings)
    print("\n| OpenMP waits | alone: step s | vs fastest alone | beside one busy process: "
          "step s | slowdown |")
    print("|---|---|---|---|---|")
    for name in args.settings:
        alone = statistics.median(times[(name, False)])
        busy = statistics.median(times[(name, True)])
        env = " ".join(f"{k}={v}" for k, v in SETTINGS[name][0].items()) or "(unset)"
        env += f", threads {SETTINGS[name][1] or 'fitted'}"
        print(f"| {name}: {env} | {alone:.2f} | {alone / best_alone:.2f}x | {busy:.2f} | "
              f"{busy / alone:.2f}x |")


if __name__ == "__main__":
    main()

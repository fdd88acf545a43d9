"""How long abandoned work holds `retrain serve` (issue 47 item 4): the next small request's
latency after clients that left, and the server's memory.

Two scenarios against a fresh `retrain serve --model MODEL` process each:

- abandoned: six /v1/completions requests of 4 prompts x n 128 x 1000 tokens whose clients give
  up (read timeout) after 2 s; then one 4-token request, timed.
- streams: eight streamed /v1/completions requests (1 prompt x n 64 x 1000 tokens) closed after
  their third chunk; then one 4-token request, timed.

Also reported: the server's RSS before and after, and how many `socket.send() raised exception`
lines its log holds. `--repo` runs another checkout's server (e.g. a worktree of an older
commit, for the before/after table):

    .venv/bin/python -m bench.serve.stall                    # this checkout, tiny-random
    .venv/bin/python -m bench.serve.stall --repo /tmp/old    # the same, another checkout's code

The small request gets `--give-up-s` (default 300 s) before it counts as "> give-up".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["one two three", "four five six", "seven eight", "nine ten"]


def start(repo: Path, model: str, dtype: str) -> tuple[subprocess.Popen, str, list[str]]:
    """`retrain serve` of `repo`'s code on a free port; its stderr lines are kept."""
    env = {**os.environ, "PYTHONPATH": str(repo), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "retrain", "serve", "--model", model,
                             "--port", "0", "--dtype", dtype], cwd=repo, env=env,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    while True:
        line = proc.stderr.readline()
        if not line:
            raise SystemExit("retrain serve exited:\n" + "".join(lines))
        lines.append(line)
        if "retrain serve: http://" in line:
            url = line.split("retrain serve: ")[1].split()[0]
            break
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    return proc, url, lines


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def abandon_requests(url: str, model: str) -> None:
    """Six large requests whose clients give up after 2 s."""
    def one() -> None:
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(f"{url}/v1/completions", timeout=2.0, json={
                "model": model, "prompt": PROMPTS, "n": 128, "max_tokens": 1000,
                "temperature": 1.0})
    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def abandon_streams(url: str, model: str) -> None:
    """Eight streams closed after their third chunk."""
    def one() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60.0, json={
                "model": model, "prompt": PROMPTS[0], "n": 64, "max_tokens": 1000,
                "temperature": 1.0, "stream": True}) as reply:
            chunks = 0
            for line in reply.iter_lines():
                chunks += line.startswith("data: ")
                if chunks >= 3:
                    break
    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def next_request_s(url: str, model: str, give_up_s: float) -> float:
    t0 = time.monotonic()
    try:
        reply = httpx.post(f"{url}/v1/completions", timeout=give_up_s, json={
            "model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0})
        reply.raise_for_status()
    except httpx.TimeoutException:
        return float("inf")
    return time.monotonic() - t0


def measure(repo: Path, model: str, dtype: str, scenario: str, give_up_s: float) -> dict:
    proc, url, lines = start(repo, model, dtype)
    try:
        next_request_s(url, model, give_up_s)  # warm
        before = rss_mb(proc.pid)
        (abandon_requests if scenario == "abandoned" else abandon_streams)(url, model)
        waited = next_request_s(url, model, give_up_s)
        after = rss_mb(proc.pid)
    finally:  # a server still decoding abandoned work may not stop on SIGTERM soon
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    floods = sum("socket.send() raised exception" in line for line in lines)
    return {"scenario": scenario, "next_request_s": round(waited, 2),
            "rss_mb_before": round(before), "rss_mb_after": round(after),
            "socket_send_lines": floods}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose server runs")
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--give-up-s", type=float, default=300.0)
    ap.add_argument("--scenario", choices=["abandoned", "streams", "both"], default="both")
    args = ap.parse_args()
    scenarios = ["abandoned", "streams"] if args.scenario == "both" else [args.scenario]
    for scenario in scenarios:
        print(json.dumps(measure(args.repo.resolve(), args.model, args.dtype, scenario,
                                 args.give_up_s)), flush=True)


if __name__ == "__main__":
    main()

"""The process that runs reward functions, so a hung scorer can be killed.

A deadline on a thread is not enough: a call stuck in C code that holds the GIL (sympy
expanding `9^{9^{9}}`, a big-integer power, a catastrophic regex) freezes every thread of
the trainer. Scoring therefore happens in a child Python process that speaks JSON lines on
stdin/stdout; the parent waits for each answer with a deadline and kills the child when it
passes. The child imports the reward (custom modules included) once, at start-up.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_CHILD = "from retrain.reward_worker import main; main()"


class WorkerProcess:
    """Parent side: one child process, one request at a time."""

    def __init__(self, setup: dict, startup_timeout_s: float):
        env = dict(os.environ)
        # The child must import this very `retrain`, wherever the parent found it.
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self._buf = b""
        status, reply = self.call(setup, startup_timeout_s)
        if status != "ok" or "error" in reply:
            self.close()
            if status == "ok":
                raise StartupError(reply["error"])
            raise StartupError("the reward worker process " + (
                f"did not start within {startup_timeout_s:g}s" if status == "timeout"
                else "exited during start-up (its error is printed above)"))

    def call(self, request: Any, timeout_s: float) -> tuple[str, Any]:
        """("ok", reply), ("timeout", None) or ("died", None)."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(request, default=str).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            return "died", None
        return self._read_line(time.monotonic() + timeout_s)

    def _read_line(self, deadline: float) -> tuple[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return "timeout", None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return "died", None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return "ok", json.loads(line)

    def close(self) -> None:
        """Stop the child now (it may be stuck, so no polite wait)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class StartupError(Exception):
    """The child could not build the reward function; the message says why."""


def main() -> None:
    """Child side: read the reward setup, then answer one JSON line per completion."""
    # Ctrl-C is the parent's to handle; it stops this process when it is done.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # a reward function's print() goes to stderr, not into the protocol
    sys.stdout = sys.stderr

    def reply(obj: Any) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    from retrain.config import RewardConfig
    from retrain.errors import UserError
    from retrain.rewards import reward_function, score_one
    from retrain.tasks import Problem

    first = sys.stdin.readline()
    if not first:  # the parent went away before asking anything
        return
    setup = json.loads(first)
    try:
        fn, binary = reward_function(RewardConfig(**setup["reward"]), Path(setup["config_dir"]))
    except UserError as exc:
        return reply({"error": str(exc)})
    except Exception as exc:
        return reply({"error": f"building the reward failed: {type(exc).__name__}: {exc}"})
    reply({"ready": True})
    for line in sys.stdin:
        item = json.loads(line)
        problem = Problem(prompt=item["prompt"], answer=item["answer"], meta=item["meta"])
        reply(score_one(fn, binary, item["text"], problem))

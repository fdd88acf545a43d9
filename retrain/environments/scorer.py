"""The reward scorer: completions are scored in a child process, so a hung scorer can be killed.

A deadline on a thread is not enough: a call stuck in C code that holds the GIL (sympy
expanding `9^{9^{9}}`, a big-integer power, a catastrophic regex) freezes every thread of
the trainer. Scoring therefore happens in a child Python process that speaks JSON lines on
stdin/stdout; the parent waits for each answer with a deadline and kills the child when it
passes. The child imports the reward (custom modules included) once, at start-up.
`Scorer.score()` never raises: a scorer that raises, returns junk, dies or runs past
`reward.timeout_s` gives 0 for that completion and counts as a failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from retrain.config.sections import RewardConfig
from retrain.environments.answers import Problem
from retrain.environments.rewards import (
    MAX_ERRORS_KEPT,
    Scores,
    clip_message,
    reward_function,
    score_one,
)
from retrain.errors import UserError

STARTUP_TIMEOUT_S = 120.0  # importing math-verify or a custom module on a busy machine
_CHILD = "from retrain.environments.scorer import main; main()"


class Scorer:
    """Scores completions one by one in a child process, each within `timeout_s`.

    The child is killed when a completion runs past its deadline (or it dies) and a fresh
    one scores the rest. One caller at a time; `close()` stops the child.
    """

    def __init__(self, reward: RewardConfig, config_dir: Path):
        self.timeout_s = reward.timeout_s
        self._setup = {"reward": dataclasses.asdict(reward), "config_dir": str(config_dir)}
        self._worker: WorkerProcess | None = self._start()

    def _start(self) -> WorkerProcess:
        try:
            return WorkerProcess(self._setup, STARTUP_TIMEOUT_S)
        except StartupError as exc:
            raise UserError(str(exc)) from None

    def score(self, texts: list[str], problems: list[Problem]) -> Scores:
        """Reward and correctness of texts[i] against problems[i]; never raises."""
        if len(texts) != len(problems):
            raise ValueError(f"{len(texts)} texts but {len(problems)} problems")
        out = Scores(rewards=[], correct=[], failures=0)
        broken = ""  # why the worker cannot be restarted during this call
        for i, (text, problem) in enumerate(zip(texts, problems, strict=True)):
            reward, correct, error = (0.0, False, broken) if broken else \
                self._score_one(text, problem)
            if error.startswith("restart failed"):
                broken = error
            out.rewards.append(reward)
            out.correct.append(correct)
            if error:
                out.failures += 1
                if len(out.errors) < MAX_ERRORS_KEPT:
                    out.errors.append(f"completion {i}: {error}")
        return out

    def _score_one(self, text: str, problem: Problem) -> tuple[float, bool, str]:
        request = {"text": text, "prompt": problem.prompt, "answer": problem.answer,
                   "meta": problem.meta}
        for attempt in range(2):
            if self._worker is None:
                try:
                    self._worker = self._start()
                except UserError as exc:
                    return 0.0, False, clip_message(f"restart failed: {exc}")
            try:
                status, reply = self._worker.call(request, self.timeout_s)
                if status == "ok":
                    reward, correct, error = reply
                    return float(reward), bool(correct), str(error)
            except Exception:  # a garbled reply: treat the process as broken
                status = "died"
            worker, self._worker = self._worker, None
            worker.close(grace_s=1.0 if status == "died" else 0.0)
            if status != "gone" or attempt:
                break
            # Killed while idle (the OOM killer, kill -9): not this completion's fault.
            print(f"warning: the reward worker process died between calls "
                  f"({worker.exit_reason()}); started a new one", file=sys.stderr, flush=True)
        if status == "timeout":
            return 0.0, False, f"timed out after {self.timeout_s:g}s"
        return 0.0, False, f"the reward process died ({worker.exit_reason()})"

    def state_dict(self) -> dict:
        """Nothing for a resume point to keep: every call stands alone (JudgeScorer's has)."""
        return {}

    def load_state_dict(self, state: dict | None) -> None:
        pass

    def close(self) -> None:
        """Stop the child process (also done when the Scorer is garbage collected)."""
        worker, self._worker = getattr(self, "_worker", None), None
        if worker is not None:
            worker.close()

    __del__ = close


def build_scorer(reward: RewardConfig, config_dir: Path, run_dir: Path | None = None,
                 slot: Any = None) -> Any:
    """A Scorer for `[reward]` (a JudgeScorer for the judge, its cache in `run_dir`, its
    requests under `slot` when given); UserError when a custom function cannot be imported
    or the judge cannot be reached."""
    if reward.type == "judge":
        from retrain.environments.judge.reward import JudgeScorer

        return JudgeScorer(reward, Path(config_dir).resolve(), run_dir, slot)
    return Scorer(reward, Path(config_dir).resolve())


# ---------------------------------------------------------------------------- the child process


class WorkerProcess:
    """Parent side of the child process: one request at a time."""

    def __init__(self, setup: dict, startup_timeout_s: float, child: str = _CHILD,
                 what: str = "the reward worker process"):
        env = dict(os.environ)
        # The child must import this very `retrain`, wherever the parent found it (not an
        # installed copy): the folder that holds the package.
        import retrain

        root = str(Path(retrain.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self._buf = b""
        self.stopped = False  # close() had to kill it
        status, reply = self.call(setup, startup_timeout_s)
        if status != "ok" or "error" in reply:
            self.close()
            if status == "ok":
                raise StartupError(reply["error"])
            raise StartupError(f"{what} " + (
                f"did not start within {startup_timeout_s:g}s" if status == "timeout"
                else "exited during start-up (its error is printed above)"))

    def call(self, request: Any, timeout_s: float) -> tuple[str, Any]:
        """("ok", reply), ("timeout", None), ("died", None) while answering, or ("gone", None):
        the child was dead before this request reached it."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(request, default=str).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            return "gone", None
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

    def close(self, grace_s: float = 0.0) -> None:
        """Stop the child: after `grace_s` for one that closed its output and is on its way
        out, at once otherwise (it may be stuck, so no polite wait)."""
        if grace_s and self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        if self.proc.poll() is None:
            self.stopped = True
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                # A request left in the buffer of a dead child's pipe: close() flushes it.
                with contextlib.suppress(OSError):
                    pipe.close()

    def exit_reason(self) -> str:
        """How the child ended, for a message (after close()): "killed by SIGKILL: ..."."""
        code = self.proc.returncode
        if self.stopped:
            return "stopped: its reply could not be read"
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            hint = ": out of memory?" if code == -signal.SIGKILL else ""
            return f"killed by {name}{hint}"
        return f"exit status {code}; its error is printed above"


class StartupError(Exception):
    """The child could not build the reward function; the message says why."""


def ignore_stop_signals() -> None:
    """Ctrl-C and SIGTERM to the process group (`timeout`, Slurm's scancel) are the parent's
    to handle: it finishes its step, then stops this process. An orphan still ends on
    SIGTERM (its parent was killed outright)."""
    parent = os.getppid()

    def on_term(signum: int, _frame: Any) -> None:
        if os.getppid() != parent:
            os._exit(128 + signum)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_term)


def main() -> None:
    """Child side: read the reward setup, then answer one JSON line per completion."""
    ignore_stop_signals()
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # a reward function's print() goes to stderr, not into the protocol
    sys.stdout = sys.stderr

    def reply(obj: Any) -> None:
        try:
            replies.write(json.dumps(obj) + "\n")
            replies.flush()
        except OSError:  # the parent is gone (Ctrl-C during its start-up): nobody to answer
            os._exit(0)

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

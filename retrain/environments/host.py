"""Where an episode's Environment lives while the rollout drives it.

`WorkerHost` runs every environment of a split in one child process (the scorer's
`WorkerProcess`, JSON lines), each call under `environment.step_timeout_s`. An environment
that raises, returns junk, hangs or kills its process ends that episode with an `EnvError`;
a hung or dead process is killed and restarted, and the other live episodes are replayed
into the new one (reset with their seed, then their replies, in order; environments are
deterministic in their seed). More than `MAX_WORKER_DEATHS` deaths in one step fail the run.

`TaskHost` is the `task` kind's host: the problem is the seed-th item of the split and the
replies of a turn are scored together by the scorer process (one batch, today's rewards).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from retrain.backends.base import BackendError
from retrain.config.sections import DataConfig, EnvironmentConfig, RewardConfig
from retrain.environments.answers import Problem
from retrain.environments.chat_problems import opening_messages
from retrain.environments.kinds import KindContext, build_factory
from retrain.environments.protocol import Message, Step
from retrain.environments.rewards import clip_message
from retrain.environments.scorer import StartupError, WorkerProcess, ignore_stop_signals
from retrain.errors import UserError

MAX_WORKER_DEATHS = 3        # per step; one more fails the run
STARTUP_TIMEOUT_S = 120.0
_CHILD = "from retrain.environments.host import main; main()"


@dataclass
class EnvError:
    """Why an environment call failed; the episode it belongs to ends."""

    message: str


@dataclass
class Opened:
    messages: list[Message]
    tools: list[dict] | None = None   # the environment's tool_schemas, if it has any


class EnvironmentFailure(BackendError):
    """The environment process keeps dying: the run stops with this message."""


class Host(Protocol):
    failures: int                     # scoring failures (task kind), counted per step
    errors: list[str]

    def reset(self, episodes: list[tuple[int, int]]) -> list[Opened | EnvError]: ...

    def step(self, replies: list[tuple[int, str]]) -> list[Step | EnvError]: ...

    def finish(self, ids: list[int]) -> list[float | EnvError]: ...

    def new_step(self) -> None: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------- task kind


class TaskHost:
    """[data] + [reward]: one turn, scored in a batch by the scorer process."""

    def __init__(self, problems: list[Problem], data: DataConfig, scorer: Any):
        self.problems, self.data, self.scorer = problems, data, scorer
        self._open: dict[int, Problem] = {}
        self.failures, self.errors = 0, []
        self.metrics: dict[str, float] = {}

    def new_step(self) -> None:
        self.failures, self.errors, self.metrics = 0, [], {}

    def reset(self, episodes: list[tuple[int, int]]) -> list[Opened | EnvError]:
        out: list[Opened | EnvError] = []
        for ep, seed in episodes:
            self._open[ep] = problem = self.problems[seed]
            out.append(Opened(opening_messages(problem, self.data)))
        return out

    def step(self, replies: list[tuple[int, str]]) -> list[Step | EnvError]:
        scores = self.scorer.score([r for _, r in replies], [self._open[e] for e, _ in replies])
        self.failures += scores.failures
        self.errors += getattr(scores, "errors", [])
        for k, v in getattr(scores, "metrics", {}).items():  # a judge's calls, errors, ...
            self.metrics[k] = self.metrics.get(k, 0) + v
        return [Step(reward=r, done=True, metrics={"correct": float(c)})
                for r, c in zip(scores.rewards, scores.correct, strict=True)]

    def finish(self, ids: list[int]) -> list[float | EnvError]:
        for ep in ids:
            self._open.pop(ep, None)
        return [0.0] * len(ids)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------- worker host


@dataclass
class _Live:
    seed: int
    replies: list[str] = field(default_factory=list)


class WorkerHost:
    """The environments of one split in a child process, each call under a deadline."""

    def __init__(self, cfg: EnvironmentConfig, ctx: KindContext):
        self.timeout_s = cfg.step_timeout_s
        self._setup = {"environment": dataclasses.asdict(cfg),
                       "context": {"split": ctx.split, "config_dir": str(ctx.config_dir),
                                   "seed": ctx.seed, "data": dataclasses.asdict(ctx.data),
                                   "reward": dataclasses.asdict(ctx.reward)}}
        self._worker: WorkerProcess | None = self._start()
        self._live: dict[int, _Live] = {}
        self.deaths = 0
        self.failures, self.errors = 0, []

    def _start(self) -> WorkerProcess:
        try:
            return WorkerProcess(self._setup, STARTUP_TIMEOUT_S, child=_CHILD,
                                 what="the environment worker process")
        except StartupError as exc:
            raise UserError(str(exc)) from None

    def new_step(self) -> None:
        self.deaths = 0
        self.failures, self.errors = 0, []

    def reset(self, episodes: list[tuple[int, int]]) -> list[Opened | EnvError]:
        out: list[Opened | EnvError] = []
        for ep, seed in episodes:
            self._live[ep] = _Live(seed)
            reply = self._call({"op": "reset", "id": ep, "seed": seed}, ep)
            out.append(reply if isinstance(reply, EnvError) else
                       Opened(reply["messages"], reply.get("tools")))
        return out

    def step(self, replies: list[tuple[int, str]]) -> list[Step | EnvError]:
        out: list[Step | EnvError] = []
        for ep, text in replies:
            reply = self._call({"op": "step", "id": ep, "reply": text}, ep)
            if not isinstance(reply, EnvError):
                self._live[ep].replies.append(text)  # replayed into a restarted worker
            out.append(reply if isinstance(reply, EnvError) else Step(**reply))
        return out

    def finish(self, ids: list[int]) -> list[float | EnvError]:
        out: list[float | EnvError] = []
        for ep in ids:
            if ep not in self._live:   # its environment already failed
                out.append(0.0)
                continue
            reply = self._call({"op": "close", "id": ep}, ep)
            self._live.pop(ep, None)
            out.append(reply if isinstance(reply, EnvError) else float(reply["reward"]))
        return out

    def _call(self, request: dict, ep: int) -> dict | EnvError:
        if self._worker is None:
            self._restart()
        assert self._worker is not None
        status, reply = self._worker.call(request, self.timeout_s)
        if status == "gone":  # killed while idle (OOM killer, kill -9): no episode's fault
            worker, self._worker = self._worker, None
            worker.close()
            print("warning: the environment worker process died between calls "
                  f"({worker.exit_reason()}); starting a new one",
                  file=sys.stderr, flush=True)
            self._died(f"it died between calls ({worker.exit_reason()})")
            if ep not in self._live:  # its replay failed
                return EnvError(f"{request['op']}: the episode could not be replayed")
            assert self._worker is not None
            status, reply = self._worker.call(request, self.timeout_s)
        if status == "ok" and "error" not in reply:
            return reply
        if status == "ok":
            return self._drop(ep, reply["error"])
        worker, self._worker = self._worker, None
        worker.close(grace_s=1.0 if status == "died" else 0.0)
        why = f"timed out after {self.timeout_s:g}s" if status == "timeout" else \
            f"the environment process died ({worker.exit_reason()})"
        self._live.pop(ep, None)
        self._died(f"{request['op']} of an episode: {why}")
        return EnvError(f"{request['op']}: {why}")

    def _drop(self, ep: int, message: str) -> EnvError:
        self._live.pop(ep, None)  # the child dropped its environment when it failed
        return EnvError(clip_message(message))

    def _died(self, why: str) -> None:
        self.deaths += 1
        if self.deaths > MAX_WORKER_DEATHS:
            raise EnvironmentFailure(f"the environment worker process died or hung "
                                     f"{self.deaths} times in one step (last: {why}); fix the "
                                     "environment or raise environment.step_timeout_s")
        self._restart()

    def _restart(self) -> None:
        """A fresh process, with every live episode replayed into it."""
        self._worker = self._start()
        for ep, live in list(self._live.items()):
            steps = [{"op": "reset", "id": ep, "seed": live.seed}] + \
                [{"op": "step", "id": ep, "reply": r} for r in live.replies]
            for request in steps:
                status, reply = self._worker.call(request, self.timeout_s)
                if status != "ok" or "error" in reply:
                    self._live.pop(ep)   # its next call gets an error
                    if status != "ok":
                        self._worker.close()
                        self._worker = None
                        self._died(f"replaying an episode: {status}")
                        return
                    break

    def close(self) -> None:
        worker, self._worker = getattr(self, "_worker", None), None
        if worker is not None:
            worker.close()

    __del__ = close


# ---------------------------------------------------------------------------- the child


def _check_messages(messages: Any, where: str) -> list[Message]:
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages):
        raise TypeError(f"{where} must return a list of {{'role': str, 'content': str}} "
                        f"messages, got {str(messages)[:200]}")
    return [dict(m) for m in messages]


def _serve(envs: dict[int, Any], factory: Any, item: dict) -> dict:
    op, ep = item["op"], item["id"]
    if op == "reset":
        env = envs[ep] = factory()
        messages = _check_messages(env.reset(int(item["seed"])), "reset()")
        if not messages:
            raise ValueError("reset() returned no messages")
        tools = getattr(env, "tool_schemas", None)
        return {"messages": messages, "tools": list(tools) if tools else None}
    if op == "step":
        step = envs[ep].step(item["reply"])
        if not isinstance(step, Step):
            raise TypeError(f"step() must return a retrain.environments.Step, got "
                            f"{type(step).__name__}")
        reward = float(step.reward)
        if not math.isfinite(reward):
            raise ValueError(f"step() gave reward {step.reward!r}, not a finite number")
        return {"messages": _check_messages(step.messages, "step()"), "reward": reward,
                "done": bool(step.done),
                "metrics": {str(k): float(v) for k, v in (step.metrics or {}).items()}}
    if op == "close":
        env = envs.pop(ep, None)
        reward = float(env.close()) if env is not None else 0.0
        if not math.isfinite(reward):
            raise ValueError(f"close() gave reward {reward!r}, not a finite number")
        return {"reward": reward}
    raise ValueError(f"unknown request {op!r}")


def main() -> None:
    """Child side: build the kind's factory, then answer one JSON line per request."""
    ignore_stop_signals()
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # an environment's print() goes to stderr, not into the protocol
    sys.stdout = sys.stderr

    def reply(obj: Any) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    first = sys.stdin.readline()
    if not first:
        return
    setup = json.loads(first)
    try:
        c = setup["context"]
        ctx = KindContext(split=c["split"], config_dir=Path(c["config_dir"]), seed=c["seed"],
                          data=DataConfig(**c["data"]), reward=RewardConfig(**c["reward"]))
        factory = build_factory(EnvironmentConfig(**setup["environment"]), ctx)
    except UserError as exc:
        return reply({"error": str(exc)})
    except Exception as exc:
        return reply({"error": f"building the environment failed: {type(exc).__name__}: "
                               f"{exc}"})
    reply({"ready": True})
    envs: dict[int, Any] = {}
    for line in sys.stdin:
        item = json.loads(line)
        try:
            reply(_serve(envs, factory, item))
        except BaseException as exc:  # SystemExit from user code included
            envs.pop(item.get("id"), None)
            reply({"error": clip_message(f"{item.get('op')}(): {type(exc).__name__}: {exc}")})

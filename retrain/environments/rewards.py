"""Reward functions: `match`, `math`, `format` (a regex) and `custom` ("module:function").

`reward_function` turns a RewardConfig into fn(text, problem) -> reward (a custom module is
imported relative to the config file); `score_one` calls it and turns any failure or junk
into a zero reward with a reason. Completions are scored in a child process: scorer.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrain.config.sections import RewardConfig
from retrain.environments.answers import (
    CORRECT_AT,
    Problem,
    is_correct,
    load_math_verify,
    match_reward,
    math_reward,
    task_reward,
)
from retrain.errors import UserError

MAX_ERRORS_KEPT = 5  # failure messages a Scores keeps


@dataclass
class Scores:
    """What a scorer (the reward process, or the judge) says about a batch of completions."""

    rewards: list[float]
    correct: list[bool]
    failures: int
    errors: list[str] = field(default_factory=list)  # the first few failure messages
    metrics: dict[str, float] = field(default_factory=dict)  # the scorer's own (judge_*)

# ---------------------------------------------------------------------------- custom rewards

_FORMAT_HINT = "use 'module:function' or 'path/to/file.py:function'"


def load_custom(spec: str, config_dir: Path, key: str = "reward.function") -> Callable[..., Any]:
    """Import the function named by `key` (reward.function, environment.factory, ...),
    relative to the config file's folder."""
    where = f"{key} = {spec!r}"
    target, sep, name = spec.strip().rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise UserError(f"{where}: {_FORMAT_HINT}")
    config_dir = Path(config_dir)
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _import_file(target, config_dir, where)
    else:
        module = _import_module(target, config_dir, where)
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items()
                         if callable(v) and not k.startswith("_"))
        raise UserError(f"{where}: {target} has no function {name!r}"
                        + (f"; it defines {', '.join(defined)}" if defined else ""))
    if not callable(fn):
        raise UserError(f"{where}: {target}.{name} is a {type(fn).__name__}, not a function")
    return fn


def _import_file(target: str, config_dir: Path, where: str) -> Any:
    path = Path(target).expanduser()
    if not path.is_absolute():
        path = config_dir / path
    if not path.is_file():
        raise UserError(f"{where}: no file {path} (relative paths start at the config file's "
                        f"folder, {config_dir})")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
    name = f"retrain_reward_{digest}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"{where}: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up here
    try:
        with _on_sys_path(path.parent, config_dir):
            spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise UserError(f"{where}: importing {path} failed: {type(exc).__name__}: {exc}") \
            from None
    return module


def _import_module(target: str, config_dir: Path, where: str) -> Any:
    try:
        with _on_sys_path(config_dir):
            return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name and (target == exc.name or target.startswith(exc.name + ".")):
            raise UserError(f"{where}: no module {target!r} in {config_dir} or on the Python "
                            "path; put it next to the config file or give a file path, "
                            "e.g. 'rewards.py:my_reward'") from None
        raise UserError(f"{where}: importing {target!r} failed: {exc}") from None
    except Exception as exc:
        raise UserError(f"{where}: importing {target!r} failed: {type(exc).__name__}: "
                        f"{exc}") from None


@contextlib.contextmanager
def _on_sys_path(*folders: Path) -> Iterator[None]:
    """Put folders first on sys.path for the duration of an import."""
    added = [str(f) for f in folders if str(f) not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for f in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(f)


def _check_signature(fn: Callable[..., Any], params: dict, spec: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and some C functions have no signature to check
    try:
        sig.bind("completion", "answer", **params)
    except TypeError as exc:
        raise UserError(f"reward.function = {spec!r} cannot be called as fn(completion, answer"
                        f", **reward.params): {exc}; make it accept (completion: str, answer: str"
                        + (", " + ", ".join(params) if params else "") + ")") from None


def reward_function(reward: RewardConfig, config_dir: Path
                    ) -> tuple[Callable[[str, Problem], Any], bool]:
    """(fn(text, problem) -> reward, whether the reward itself is the correctness)."""
    kind = reward.type
    if kind == "match":
        return (lambda t, p: task_reward(t, p, match_reward)), True
    if kind == "math":
        load_math_verify()  # import it now, not against the first completion's deadline
        return (lambda t, p: task_reward(t, p, math_reward)), True
    if kind == "format":
        try:
            rx = re.compile(reward.pattern)
        except re.error as exc:
            raise UserError(f"reward.pattern = {reward.pattern!r} is not a valid regex: "
                            f"{exc}") from None
        return (lambda t, p: 1.0 if rx.search(t) else 0.0), False
    if kind == "custom":
        fn = load_custom(reward.function, config_dir)
        params = dict(reward.params)
        _check_signature(fn, params, reward.function)
        return (lambda t, p: fn(t, p.answer, **params)), False
    if kind == "judge":  # the judge scores in the trainer's process (judge.py), per batch
        raise UserError("reward.type = 'judge' scores the task kind without tools; remove "
                        "environment.tools or use another reward")
    raise UserError(f"reward.type = {kind!r}; use 'match', 'math', 'format' or 'custom'")


def score_one(fn: Callable[[str, Problem], Any], reward_is_correctness: bool, text: str,
              problem: Problem) -> tuple[float, bool, str]:
    """(reward, correct, error); a failing or junk-returning `fn` gives (0, False, why)."""
    try:
        value = fn(text, problem)
    except BaseException as exc:  # SystemExit from a user function included
        return 0.0, False, clip_message(f"{type(exc).__name__}: {exc}")
    reward = _as_reward(value)
    if reward is None:
        return 0.0, False, clip_message(f"returned {value!r}, not a finite number")
    correct = reward >= CORRECT_AT if reward_is_correctness else is_correct(text, problem)
    return reward, correct, ""


def _as_reward(value: Any) -> float | None:
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        reward = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return reward if math.isfinite(reward) else None


def clip_message(message: str, limit: int = 300) -> str:
    return message if len(message) <= limit else message[: limit - 3] + "..."



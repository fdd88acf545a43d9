"""The environment kinds: `[environment] kind = ...` -> the builder of one episode's Environment.

A builder is `build(cfg: EnvironmentConfig, ctx: KindContext) -> factory`, where `factory()`
makes ONE episode's Environment (its `reset(seed)` picks the item or game). Builders are
named "module:function" and imported lazily: the worker process that hosts environments
imports them by that name, and a kind whose optional library is missing costs nothing until
it is used (it raises `MissingExtra`, one line naming the pip command).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from retrain.config.sections import DataConfig, EnvironmentConfig, RewardConfig
from retrain.environments.protocol import Environment
from retrain.errors import UserError

Factory = Callable[[], Environment]


@dataclass(frozen=True)
class KindContext:
    """Where a builder runs: the split (train items or held-out ones), the config file's folder
    (relative paths start there) and the run's seed. `data` and `reward` are the [data] and
    [reward] sections, which only the `task` kind reads."""

    split: Literal["train", "eval"]
    config_dir: Path
    seed: int
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)


KindBuilder = Callable[[EnvironmentConfig, KindContext], Factory]

KINDS: dict[str, str] = {
    "task": "retrain.environments.task_kind:build",
    "python": "retrain.environments.python_kind:build",
    "guess_number": "retrain.environments.guess_number:build",
    "reasoning_gym": "retrain.environments.adapters.reasoning_gym:build",
    "textarena": "retrain.environments.adapters.textarena:build",
    "verifiers": "retrain.environments.adapters.verifiers:build",
    "lookup": "retrain.environments.tools.lookup:build",
}

EXTRAS_PIP = "pip install 'retrain[environments]'"


class MissingExtra(UserError):
    """A kind's optional library is not installed; the message is one line naming the fix."""

    def __init__(self, what: str, pip_command: str = EXTRAS_PIP):
        super().__init__(f"{what} is not installed; install it with: {pip_command}")
        self.pip_command = pip_command


def import_by_name(spec: str) -> Any:
    """The object named "package.module:attribute"."""
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def builder(kind: str) -> KindBuilder:
    """The builder of `kind`; UserError naming the kinds there are when it is unknown."""
    spec = KINDS.get(kind)
    if spec is None:
        raise UserError(f"environment.kind = {kind!r} is not a kind; use one of "
                        + ", ".join(sorted(KINDS)))
    try:
        return import_by_name(spec)
    except ModuleNotFoundError as exc:
        raise UserError(f"environment.kind = {kind!r}: its module is missing ({exc})") from None


def default_max_turns(cfg: EnvironmentConfig) -> int:
    """environment.max_turns, where 0 means 1 for the task kind and 8 for the others."""
    if cfg.max_turns:
        return cfg.max_turns
    return 1 if cfg.kind == "task" else 8


def episode_token_bound(cfg: EnvironmentConfig, max_tokens: int) -> int:
    """The most tokens the model may sample in one episode: max_turns x training.max_tokens,
    or the episode budget when that is smaller."""
    bound = default_max_turns(cfg) * max_tokens
    return min(bound, cfg.max_episode_tokens) if cfg.max_episode_tokens else bound


def build_factory(cfg: EnvironmentConfig, ctx: KindContext) -> Factory:
    """The factory of one episode's Environment for `cfg`, tools included when configured."""
    factory = builder(cfg.kind)(cfg, ctx)
    if cfg.tools:
        with_tools = import_by_name("retrain.environments.tools:with_tools")
        factory = with_tools(factory, list(cfg.tools), cfg.tool_max_chars, ctx.config_dir)
    return factory

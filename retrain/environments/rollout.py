"""The rollout: one step's episodes, sampled together one turn at a time.

Turn 0 samples `n` episodes per group from the group's opening prompt (one backend call, as
single-turn training always did); each later turn samples one reply per live episode
(`n = 1`) from that episode's own token sequence. Finished episodes drop out. The token
ledger (retrain/environments/ledger.py) keeps each episode's sequence: the model's tokens as
sampled (mask 1), the environment's as the template renders them (mask 0).

An episode ends when its environment says done, when `max_turns` replies were made
(`max_turns_hit`), on a reply cut at `training.max_tokens` with `on_length = "end"`, when the
next turn would not fit `max_episode_tokens` or the model's context (checked before sampling,
never after; an opening longer than the context is an error), or when
its environment fails (`env_errors`). Its reward is the sum of its step rewards plus
`close()`, plus `length_reward` when it ended on a cut reply or the token budget.

The trainer only calls `Rollout.run` and `episode_datum`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from retrain.backends.base import (
    Backend,
    Completion,
    Datum,
    SamplingParams,
    context_overflow,
)
from retrain.config.sections import DataConfig, EnvironmentConfig, RewardConfig
from retrain.environments.answers import CORRECT_AT, Problem
from retrain.environments.host import EnvError, Host, Opened, TaskHost, WorkerHost
from retrain.environments.kinds import KindContext, default_max_turns
from retrain.environments.ledger import Ledger, Renderer
from retrain.environments.protocol import Message, Step
from retrain.run.seeds import derive_seed, keyed_seeds

COUNTED_METRICS = ("correct", "tool_calls")  # Step.metrics keys the rollout reads itself


@dataclass(eq=False)
class Episode:
    """One episode: its ledger, its messages, how it ended and its reward."""

    id: int                    # its place in the step: group * n + member
    group: int
    seed: int
    ledger: Ledger = field(default_factory=Ledger)
    history: list[Message] = field(default_factory=list)
    tools: list[dict] | None = None
    reward: float = 0.0
    turns: int = 0
    ended: str = ""            # done | max_turns | length | budget | error
    error: str = ""
    correct: bool | None = None
    tool_calls: int = 0
    cut_replies: int = 0       # replies that hit max_tokens
    metrics: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    last: Completion | None = None

    @property
    def live(self) -> bool:
        return not self.ended

    @property
    def success(self) -> bool:
        return self.correct if self.correct is not None else self.reward >= CORRECT_AT


@dataclass
class RolloutResult:
    groups: list[list[Episode]]
    dropped: list[bool]          # on_env_error = "drop_group": this group is not trained
    env_seconds: float
    bridges: int
    reward_metrics: dict[str, float] = field(default_factory=dict)  # the scorer's (judge_*)

    def rewards(self) -> list[list[float]]:
        return [[e.reward for e in g] for g in self.groups]

    def metrics(self) -> dict[str, float]:
        """The per-step environment metrics of the run's row."""
        eps = [e for g in self.groups for e in g]
        n = max(1, len(eps))
        row = {"mean_turns": sum(e.turns for e in eps) / n,
               "max_turns_hit": sum(e.ended == "max_turns" for e in eps) / n,
               "episode_tokens": sum(len(e.ledger.tokens) for e in eps) / n,
               "env_seconds": self.env_seconds,
               "env_errors": sum(e.ended == "error" for e in eps),
               "truncated": sum(e.ended in ("length", "budget") for e in eps) / n,
               "bridges": self.bridges,
               "tool_calls": sum(e.tool_calls for e in eps)}
        extra: dict[str, list[float]] = defaultdict(list)
        for e in eps:
            for k, values in e.metrics.items():
                extra[k] += values
        row.update({f"env_{k}": sum(v) / len(v) for k, v in sorted(extra.items()) if v})
        return row


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The sampling seed of turn `turn` (turn 0 keeps the step's own seed: single-turn
    training samples exactly as before), derived like every other seed (`seeds`)."""
    if seed is None or turn == 0:
        return seed
    return derive_seed(seed, turn, "turn")


def keyed(params: SamplingParams, keys: range | list[int]) -> SamplingParams:
    """`params` with one seed per prompt, keyed by `keys` (the prompts' groups, or episodes,
    numbered over the whole step): unseeded params (eval's greedy) stay as they are."""
    if params.seed is None:
        return params
    return dataclasses.replace(params, prompt_seeds=keyed_seeds(params.seed, keys))


class Rollout:
    """Drives the episodes of one split: a host for the environments, a backend to sample."""

    def __init__(self, backend: Backend, host: Host, renderer: Renderer,
                 cfg: EnvironmentConfig, max_turns: int):
        self.backend, self.host, self.renderer = backend, host, renderer
        self.cfg, self.max_turns = cfg, max_turns
        self.max_context = backend.max_context  # no episode grows past the model's positions
        self.bridges = 0
        self._first_group = 0  # the step's number of this call's first group (`run`)
        self._opening: dict[int, list[int]] = {}

    # ------------------------------------------------------------------ opening prompts

    def prompt(self, seed: int) -> list[int]:
        """The turn-0 prompt of a group with this seed (cached; resets a throwaway episode)."""
        if seed not in self._opening:
            opened = self.host.reset([(-1, seed)])[0]
            self.host.finish([-1])
            if isinstance(opened, EnvError):
                return []
            self._opening[seed] = self.renderer.render(opened.messages, True, opened.tools)
        return self._opening[seed]

    # ------------------------------------------------------------------ the episodes

    def run(self, seeds: list[int], n: int, params: SamplingParams,
            first: list[list[Completion]] | None = None, first_group: int = 0) -> RolloutResult:
        """`n` episodes for each seed; `first`: turn 0, already sampled (overlap, with
        `keyed` params); `first_group`: the step's number of the first (draws are keyed by
        the group's and episode's number in the whole step)."""
        self.host.new_step()
        self._first_group = first_group
        self.bridges, env_seconds = 0, 0.0
        groups = [[Episode(id=g * n + j, group=g, seed=s) for j in range(n)]
                  for g, s in enumerate(seeds)]
        flat = [e for g in groups for e in g]
        t = time.perf_counter()
        opened = self.host.reset([(e.id, e.seed) for e in flat])
        env_seconds += time.perf_counter() - t
        prompts = self._open(groups, opened)
        for turn in range(self.max_turns):
            live = [e for e in flat if e.live]
            if not live:
                break
            if turn == 0:
                self._sample_first(groups, prompts, n, params, first)
            else:
                self._sample_next(live, n, dataclasses.replace(
                    params, seed=turn_seed(params.seed, turn)))
            sampled = [e for e in live if e.live and e.last is not None]
            t = time.perf_counter()
            steps = self.host.step([(e.id, self._text(e)) for e in sampled]) if sampled else []
            env_seconds += time.perf_counter() - t
            for e, step in zip(sampled, steps, strict=True):
                self._after(e, step, last_turn=turn == self.max_turns - 1)
        t = time.perf_counter()
        closes = self.host.finish([e.id for e in flat])
        env_seconds += time.perf_counter() - t
        for e, closed in zip(flat, closes, strict=True):
            if isinstance(closed, EnvError):
                self._fail(e, closed.message)
            elif e.ended != "error":
                e.reward += closed
        for e in flat:  # finite step rewards whose sum overflows: an environment error
            if e.ended != "error" and not math.isfinite(e.reward):
                self._fail(e, f"its rewards sum to {e.reward} (beyond a float); scored as "
                              "environment.on_env_error says")
        drop = self.cfg.on_env_error == "drop_group"
        for e in flat:
            if e.ended == "error":
                e.reward = 0.0
        dropped = [drop and any(e.ended == "error" for e in g) for g in groups]
        return RolloutResult(groups, dropped, env_seconds, self.bridges,
                             dict(getattr(self.host, "metrics", {})))

    def _open(self, groups: list[list[Episode]], opened: list[Opened | EnvError]
              ) -> list[list[int] | None]:
        """Each episode's opening in its ledger; the group's prompt (None: all failed)."""
        prompts: list[list[int] | None] = []
        it = iter(opened)
        for group in groups:
            prompt, shown = None, None
            for e in group:
                o = next(it)
                if isinstance(o, EnvError):
                    self._fail(e, o.message)
                    continue
                same = shown is not None and (o.messages, o.tools) == shown
                ids = prompt if same else self.renderer.render(o.messages, True, o.tools)
                if prompt is None:
                    prompt, shown = ids, (o.messages, o.tools)
                    self._opening.setdefault(e.seed, ids)
                elif ids != prompt:
                    self._fail(e, "reset() gave another opening for the same seed; an "
                                  "environment must be deterministic in its seed")
                    continue
                e.history, e.tools = list(o.messages), o.tools
                e.ledger.add_fixed(ids)
            prompts.append(prompt)
        return prompts

    def _sample_first(self, groups: list[list[Episode]], prompts: list[list[int] | None],
                      n: int, params: SamplingParams,
                      first: list[list[Completion]] | None) -> None:
        if first is None:
            todo = [(g, p) for g, p in enumerate(prompts) if p is not None]
            by_budget: dict[int, list[tuple[int, list[int]]]] = defaultdict(list)
            for g, p in todo:
                room = self._room(len(p), params.max_tokens)
                too_long = context_overflow(len(p), 1, self.max_context)
                if room <= 0:
                    for e in groups[g]:
                        if too_long:  # nothing can be sampled: say why
                            self._fail(e, f"the opening does not fit: {too_long}")
                        else:
                            self._end_on_budget(e)
                else:
                    by_budget[room].append((g, p))
            first = [[] for _ in groups]
            for room, items in by_budget.items():
                keys = [self._first_group + g for g, _ in items]
                out = self.backend.sample([p for _, p in items], n, keyed(
                    dataclasses.replace(params, max_tokens=room), keys))
                for (g, _), completions in zip(items, out, strict=True):
                    first[g] = completions
        for group, completions in zip(groups, first, strict=True):
            for e, c in zip(group, completions, strict=False):
                if e.live:
                    self._take(e, c)

    def _sample_next(self, live: list[Episode], n: int, params: SamplingParams) -> None:
        by_budget: dict[int, list[Episode]] = defaultdict(list)
        for e in live:
            room = self._room(len(e.ledger.tokens), params.max_tokens)
            if room <= 0:
                self._end_on_budget(e)
            else:
                by_budget[room].append(e)
        for room, eps in by_budget.items():
            keys = [self._first_group * n + e.id for e in eps]  # the episode's in the step
            out = self.backend.sample([e.ledger.tokens for e in eps], 1, keyed(
                dataclasses.replace(params, max_tokens=room), keys))
            for e, completions in zip(eps, out, strict=True):
                self._take(e, completions[0])

    def _room(self, used: int, max_tokens: int) -> int:
        """How many tokens the next reply may have: max_tokens, less what the budget or the
        model's context lacks (an episode at either ends on `budget`)."""
        budget = self.cfg.max_episode_tokens
        room = max_tokens if not budget else min(max_tokens, budget - used)
        return room if self.max_context is None else min(room, self.max_context - used)

    def _take(self, e: Episode, c: Completion) -> None:
        e.last = c
        e.turns += 1
        e.cut_replies += c.finish_reason == "length"
        e.ledger.add_sampled(list(c.tokens), list(c.logprobs))

    def _text(self, e: Episode) -> str:
        assert e.last is not None
        text = self.backend.tokenizer.decode(e.last.tokens, skip_special_tokens=True)
        e.history.append({"role": "assistant", "content": text})
        return text

    def _after(self, e: Episode, step: Step | EnvError, last_turn: bool) -> None:
        """Apply the environment's answer to a reply: end the episode or extend its ledger."""
        if isinstance(step, EnvError):
            return self._fail(e, step.message)
        e.reward += step.reward
        for k, v in step.metrics.items():
            if k == "correct":
                e.correct = v >= CORRECT_AT
            elif k == "tool_calls":
                e.tool_calls += int(v)
            else:
                e.metrics[k].append(float(v))
        assert e.last is not None
        cut = e.last.finish_reason == "length"
        if step.done:
            e.ended = "done"
        elif cut and self.cfg.on_length == "end":
            e.ended = "length"
            e.reward += self.cfg.length_reward
        elif last_turn:
            e.ended = "max_turns"
        if not e.live:
            return
        stopped_on = None if cut or not e.last.tokens else e.last.tokens[-1]
        part, bridged = self.renderer.env_part(e.history, step.messages, stopped_on, e.tools)
        self.bridges += bridged
        if self._room(len(e.ledger.tokens) + len(part), 1) <= 0:
            return self._end_on_budget(e)
        e.ledger.add_fixed(part)
        e.history += step.messages

    def _end_on_budget(self, e: Episode) -> None:
        e.ended = "budget"
        e.reward += self.cfg.length_reward

    def _fail(self, e: Episode, message: str) -> None:
        e.ended, e.error = "error", message


def episode_datum(e: Episode, advantage: float) -> Datum:
    """The shifted datum of one episode: the one shift, exactly as `make_datum` does it."""
    tokens, mask, lps = e.ledger.tokens, e.ledger.mask, e.ledger.logprobs
    adv = float(advantage)
    return Datum(input_tokens=tokens[:-1], target_tokens=tokens[1:], logprobs=lps[1:],
                 advantages=[adv if m else 0.0 for m in mask[1:]], mask=mask[1:])


# ---------------------------------------------------------------------------- setup


@dataclass
class Rollouts:
    """The train split's rollout, and the held-out split's (built on first use)."""

    train: Rollout
    make_eval: Callable[[], Rollout] | None   # None: the task kind evaluates with the scorer
    _eval: Rollout | None = None

    @property
    def eval(self) -> Rollout:
        if self._eval is None:
            assert self.make_eval is not None
            self._eval = self.make_eval()
        return self._eval

    def close(self) -> None:
        for r in (self.train, self._eval):
            if r is not None:
                r.host.close()


def uses_scorer(cfg: EnvironmentConfig) -> bool:
    """The task kind without tools: its replies are scored by the [reward] scorer process."""
    return cfg.kind == "task" and not cfg.tools


def build_rollouts(cfg: EnvironmentConfig, data: DataConfig, reward: RewardConfig, seed: int,
                   config_dir: Path, backend: Backend, scorer: Any,
                   problems: list[Problem]) -> Rollouts:
    """The rollouts of a run: `task` on the scorer, every other kind in a worker process."""
    turns = default_max_turns(cfg)
    if uses_scorer(cfg):
        host: Host = TaskHost(problems, data, scorer)
        train = Rollout(backend, host, Renderer(backend.tokenizer, data.chat_template), cfg,
                        turns)
        return Rollouts(train, None)
    chat = data.chat_template if cfg.kind == "task" else True

    def rollout(split: Literal["train", "eval"]) -> Rollout:
        ctx = KindContext(split=split, config_dir=config_dir, seed=seed, data=data,
                          reward=reward)
        return Rollout(backend, WorkerHost(cfg, ctx), Renderer(backend.tokenizer, chat), cfg,
                       turns)

    return Rollouts(rollout("train"), lambda: rollout("eval"))

"""The `task` kind: today's [data] + [reward] as a one-turn Environment.

The episode's seed is the item's index in the split (the trainer's data cursor picks it), the
opening message is the prompt, and the one reply is scored by [reward]. The rollout scores
the task kind's replies in a batch through the scorer process (same rewards, one round trip);
this Environment is what a per-episode host runs (e.g. when tools wrap the task).
"""

from __future__ import annotations

from collections.abc import Callable

from retrain.config.sections import DataConfig, EnvironmentConfig
from retrain.environments.answers import Problem
from retrain.environments.chat_problems import opening_messages
from retrain.environments.kinds import Factory, KindContext
from retrain.environments.protocol import Environment, Message, Step
from retrain.environments.rewards import reward_function, score_one
from retrain.environments.tasks import load_task
from retrain.errors import UserError


class TaskEnvironment(Environment):
    """One problem, one reply, scored by the [reward] function."""

    def __init__(self, problems: list[Problem], data: DataConfig,
                 score: Callable[[str, Problem], tuple[float, bool, str]]):
        self.problems, self.data, self.score = problems, data, score
        self.problem: Problem | None = None

    def reset(self, seed: int) -> list[Message]:
        self.problem = self.problems[seed % len(self.problems)]
        return opening_messages(self.problem, self.data)

    def step(self, reply: str) -> Step:
        assert self.problem is not None, "step() before reset()"
        reward, correct, _ = self.score(reply, self.problem)
        return Step(reward=reward, done=True, metrics={"correct": float(correct)})


def build(cfg: EnvironmentConfig, ctx: KindContext) -> Factory:
    splits = load_task(ctx.data, ctx.seed, ctx.config_dir)
    problems = splits.train if ctx.split == "train" else splits.eval
    fn, binary = reward_function(ctx.reward, ctx.config_dir)

    def score(reply: str, problem: Problem):
        return score_one(fn, binary, reply, problem)

    if not problems:
        raise UserError(f"environment.kind = 'task': the {ctx.split} split has no problems "
                        "(raise data.size or data.eval_size)")
    return lambda: TaskEnvironment(problems, ctx.data, score)

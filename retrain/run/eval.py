"""Greedy evaluation on the held-out split: eval_accuracy = fraction of correct completions
(for an environment: of successful held-out episodes, with their mean reward); `HeldOut`:
when a run evaluates and what it puts on the row."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from retrain.backends.base import Backend, SamplingParams, TokenIds
from retrain.bill.tally import JUDGE_TOKENS
from retrain.environments.answers import Problem
from retrain.environments.rollout import Rollout
from retrain.environments.tasks import render_prompt
from retrain.run.seeds import heldout_episode_seeds


@dataclass
class EvalResult:
    accuracy: float
    mean_reward: float
    seconds: float
    n: int
    spent: dict[str, float] = field(default_factory=dict)  # the judge's tokens (run/spend.py)


def evaluate(backend: Backend, prompts: list[TokenIds], problems: list[Problem], scorer: Any,
             max_tokens: int, chunk: int = 64, stop: tuple[str, ...] = ()) -> EvalResult:
    """One greedy completion per held-out problem (temperature 0), scored like training;
    `stop`: training.stop, the stop strings."""
    start = time.perf_counter()
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_strings=stop)
    texts: list[str] = []
    for i in range(0, len(prompts), chunk):
        groups = backend.sample(prompts[i:i + chunk], 1, greedy)
        texts += [backend.tokenizer.decode(g[0].tokens, skip_special_tokens=True)
                  for g in groups]
    scores = scorer.score(texts, problems)
    n = len(problems)
    return EvalResult(accuracy=sum(scores.correct) / n if n else 0.0,
                      mean_reward=sum(scores.rewards) / n if n else 0.0,
                      seconds=time.perf_counter() - start, n=n,
                      spent=_judge_tokens(getattr(scores, "metrics", {})))


def evaluate_episodes(rollout: Rollout, seeds: list[int], max_tokens: int,
                      stop: tuple[str, ...] = ()) -> EvalResult:
    """One greedy episode per held-out seed: the success rate and the mean episode reward."""
    start = time.perf_counter()
    result = rollout.run(seeds, 1, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                  stop_strings=stop))
    episodes = [g[0] for g in result.groups]
    n = len(episodes)
    return EvalResult(accuracy=sum(e.success for e in episodes) / n if n else 0.0,
                      mean_reward=sum(e.reward for e in episodes) / n if n else 0.0,
                      seconds=time.perf_counter() - start, n=n,
                      spent=_judge_tokens(result.reward_metrics))


def _judge_tokens(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k in JUDGE_TOKENS}


class HeldOut:
    """The run's held-out evaluation: before the first step and after every `eval_every`-th
    step and the last (greedy problems of the task's eval split, or held-out episodes)."""

    def __init__(self, backend: Backend, rollouts: Any, eval_split: list[Problem], scorer: Any,
                 data: Any, training: Any):
        self.backend, self.rollouts, self.problems = backend, rollouts, eval_split
        self.scorer, self.data, self.training = scorer, data, training
        self._prompts: list[TokenIds] | None = None
        self._spent: dict[str, float] = {}  # judge tokens not on a row yet

    def take_spent(self) -> dict[str, float]:
        """The judge tokens the evaluations spent since the last call (run/spend.py)."""
        spent, self._spent = self._spent, {}
        return spent

    def available(self) -> bool:
        if self.rollouts.make_eval is None:
            return bool(self.problems)
        return self.data.eval_size > 0

    def due(self, step: int) -> bool:
        every, last = self.training.eval_every, self.training.max_steps
        return self.available() and (step == last or bool(every and step % every == 0))

    def run(self) -> EvalResult:
        result = self._run()
        for k, v in result.spent.items():
            self._spent[k] = self._spent.get(k, 0) + v
        return result

    def _run(self) -> EvalResult:
        training, stop = self.training, tuple(self.training.stop)
        if self.rollouts.make_eval is not None:  # an environment: held-out episodes
            seeds = heldout_episode_seeds(training.seed, self.data.eval_size)
            return evaluate_episodes(self.rollouts.eval, seeds, training.max_tokens, stop=stop)
        if self._prompts is None:
            self._prompts = [render_prompt(self.backend.tokenizer, p, self.data)
                             for p in self.problems]
        chunk = max(16, training.batch_size * training.group_size)
        return evaluate(self.backend, self._prompts, self.problems, self.scorer,
                        training.max_tokens, chunk=chunk, stop=stop)

    def into_row(self, row: dict) -> EvalResult:
        """Evaluate now and put the result on the step's row."""
        result = self.run()
        row["eval_accuracy"] = result.accuracy
        if self.rollouts.make_eval is not None:
            row["eval_mean_reward"] = result.mean_reward
        row["eval_time_s"] = result.seconds
        return result

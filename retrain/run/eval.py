"""Greedy evaluation on the held-out split: eval_accuracy = fraction of correct completions
(for an environment: of successful held-out episodes, with their mean reward)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from retrain.backends.base import Backend, SamplingParams, TokenIds
from retrain.environments.answers import Problem
from retrain.environments.rollout import Rollout


@dataclass
class EvalResult:
    accuracy: float
    mean_reward: float
    seconds: float
    n: int


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
                      seconds=time.perf_counter() - start, n=n)


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
                      seconds=time.perf_counter() - start, n=n)

"""Greedy evaluation on the held-out split: eval_accuracy = fraction of correct completions
(for an environment: of successful held-out episodes, with their mean reward); with
training.eval_samples = k > 1 also k seeded samples per problem: mean@k, pass@k and the
standard error of mean@k (results/stats.py `at_k`). `HeldOut`: when a run evaluates and what
it puts on the row."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from retrain.backends.base import Backend, SamplingParams, TokenIds
from retrain.bill.tally import JUDGE_TOKENS
from retrain.environments.answers import Problem
from retrain.environments.rollout import Rollout
from retrain.environments.tasks import render_prompt
from retrain.run.at_k import AtK, at_k
from retrain.run.seeds import derive_seed, heldout_episode_seeds

Sample = Callable[[list[TokenIds], int, SamplingParams], list[list[Any]]]


@dataclass
class EvalResult:
    accuracy: float
    mean_reward: float
    seconds: float
    n: int
    spent: dict[str, float] = field(default_factory=dict)  # the judge's tokens (run/spend.py)
    sampled: AtK | None = None  # eval_samples > 1: the k samples' mean@k, pass@k, its error


def eval_temperature(training: Any) -> float:
    """training.eval_temperature, "auto" being training.temperature (the policy as trained)."""
    t = training.eval_temperature
    return training.temperature if t == "auto" else float(t)


def sampled_params(training: Any, temperature: float) -> SamplingParams:
    """The sampled eval's params: one seed per run (the trainer's and `retrain eval`'s), the
    same at every eval, so two evals of a run differ by the weights, not by the draws."""
    return SamplingParams(max_tokens=training.max_tokens, temperature=temperature,
                          seed=derive_seed(training.seed, 0, "eval-samples"),
                          stop_strings=tuple(training.stop))


def sample_k(sample: Sample, prompts: list[TokenIds], k: int, params: SamplingParams,
             rows: int) -> list[list[Any]]:
    """`k` completions per prompt through `sample` (one batched decode a call): n = k for
    `rows // k` prompts a call (a training step's rows, so memory stays a step's; k > rows:
    n = rows, in pieces); each call seeded from params.seed and its index, its own draws."""
    per = min(k, rows)
    width = max(1, rows // per)
    out: list[list[Any]] = [[] for _ in prompts]
    call = 0
    for start in range(0, k, per):
        for i in range(0, len(prompts), width):
            seed = derive_seed(params.seed or 0, call, "eval-samples")
            got = sample(prompts[i:i + width], min(per, k - start), replace(params, seed=seed))
            for mine, theirs in zip(out[i:i + width], got, strict=True):
                mine += theirs
            call += 1
    return out


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


def evaluate_sampled(backend: Backend, prompts: list[TokenIds], problems: list[Problem],
                     scorer: Any, k: int, params: SamplingParams, rows: int) -> EvalResult:
    """`k` seeded samples per held-out problem, scored like training: mean@k and pass@k."""
    start = time.perf_counter()
    groups = sample_k(backend.sample, prompts, k, params, rows)
    texts = [backend.tokenizer.decode(c.tokens, skip_special_tokens=True)
             for g in groups for c in g]
    scores = scorer.score(texts, [p for p in problems for _ in range(k)])
    correct = [bool(c) for c in scores.correct]
    n = len(problems)
    return EvalResult(accuracy=sum(correct) / len(correct) if correct else 0.0,
                      mean_reward=sum(scores.rewards) / len(correct) if correct else 0.0,
                      seconds=time.perf_counter() - start, n=n,
                      spent=_judge_tokens(getattr(scores, "metrics", {})),
                      sampled=at_k([correct[i * k:(i + 1) * k] for i in range(n)]))


def evaluate_episodes(rollout: Rollout, seeds: list[int], max_tokens: int,
                      stop: tuple[str, ...] = (), k: int = 1,
                      params: SamplingParams | None = None) -> EvalResult:
    """One greedy episode per held-out seed: the success rate and the mean episode reward;
    `k` > 1: k episodes per seed sampled with `params` (mean@k and pass@k of the successes)."""
    start = time.perf_counter()
    params = params or SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_strings=stop)
    result = rollout.run(seeds, k, params)
    episodes = [e for g in result.groups for e in g]
    n = len(episodes)
    return EvalResult(accuracy=sum(e.success for e in episodes) / n if n else 0.0,
                      mean_reward=sum(e.reward for e in episodes) / n if n else 0.0,
                      seconds=time.perf_counter() - start, n=len(result.groups),
                      spent=_judge_tokens(result.reward_metrics),
                      sampled=at_k([[bool(e.success) for e in g] for g in result.groups])
                      if k > 1 else None)


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
        greedy = self._evaluate(1, None)
        k = self.training.eval_samples
        if k == 1:
            return greedy
        sampled = self._evaluate(k, sampled_params(self.training,
                                                   eval_temperature(self.training)))
        spent = {key: greedy.spent.get(key, 0) + sampled.spent.get(key, 0)
                 for key in {*greedy.spent, *sampled.spent}}
        return replace(greedy, seconds=greedy.seconds + sampled.seconds, spent=spent,
                       sampled=sampled.sampled)

    def _evaluate(self, k: int, params: SamplingParams | None) -> EvalResult:
        """Greedy (k = 1), or k samples per problem with `params`."""
        training, stop = self.training, tuple(self.training.stop)
        rows = max(16, training.batch_size * training.group_size)  # a training step's
        if self.rollouts.make_eval is not None:  # an environment: held-out episodes
            seeds = heldout_episode_seeds(training.seed, self.data.eval_size)
            return evaluate_episodes(self.rollouts.eval, seeds, training.max_tokens, stop=stop,
                                     k=k, params=params)
        if self._prompts is None:
            self._prompts = [render_prompt(self.backend.tokenizer, p, self.data)
                             for p in self.problems]
        if params is not None:
            return evaluate_sampled(self.backend, self._prompts, self.problems, self.scorer,
                                    k, params, rows)
        return evaluate(self.backend, self._prompts, self.problems, self.scorer,
                        training.max_tokens, chunk=rows, stop=stop)

    def into_row(self, row: dict) -> EvalResult:
        """Evaluate now and put the result on the step's row."""
        result = self.run()
        self.put(row, result)
        row["eval_time_s"] = result.seconds
        return result

    def put(self, row: dict, result: EvalResult, prefix: str = "") -> None:
        """The result's figures on `row` (`prefix` "initial_": the eval before training);
        the sampled ones only with eval_samples > 1, so greedy rows stay as they were."""
        row[f"{prefix}eval_accuracy"] = result.accuracy
        if self.rollouts.make_eval is not None and not prefix:
            row["eval_mean_reward"] = result.mean_reward
        if (s := result.sampled) is not None:
            row[f"{prefix}eval_mean_at_k"] = s.mean_at_k
            row[f"{prefix}eval_pass_at_k"] = s.pass_at_k
            if s.mean_at_k_se is not None:
                row[f"{prefix}eval_mean_at_k_se"] = s.mean_at_k_se

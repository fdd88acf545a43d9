"""A step's training batch: the episodes sampled (more rounds while too few groups carry
signal, with `training.refill`), their rewards shaped (overlong shaping, the KL to the base
model when it goes in the reward), the group advantages, and the datums of the groups that
train.

Order, per sampling round: the environment's rewards -> + overlong penalty -> - kl_coef x the
completion's KL (kl_in = "reward") = the shaped rewards; then, over all rounds, the advantages
of the shaped rewards. With none of these keys set, the shaped rewards are the rewards and
the advantages are computed exactly as they always were.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from retrain.algorithms.advantages import bounded_for_loss, compute_advantages
from retrain.algorithms.kl import sequence_kl
from retrain.algorithms.overlong import overlong_penalty
from retrain.algorithms.refill import kept_advantages, signal, to_draw
from retrain.backends.base import Backend, Datum
from retrain.environments.host import Host
from retrain.environments.rollout import Episode, RolloutResult, episode_datum

# (refill round, groups to draw, groups drawn so far) -> those groups' episodes
DrawMore = Callable[[int, int, int], RolloutResult]


@dataclass
class Batch:
    """What a step trains on, and what its row says about it."""

    result: RolloutResult               # every episode sampled this step, all rounds
    rewards: list[list[float]]          # as the environment scored them, per group
    advantages: list[list[float]]
    groups: list[list[Datum]]           # the datums of each group that trains
    divisor: float                      # advantages were divided by it for the loss (1: not)
    metrics: dict = field(default_factory=dict)
    refill_seconds: float = 0.0         # spent sampling the refill rounds


class BatchBuilder:
    """Shapes, refills and turns a step's episodes into datums, as the config says."""

    def __init__(self, backend: Backend, host: Host, algorithm, training, reward):
        self.backend, self.host = backend, host
        self.algorithm, self.training, self.reward = algorithm, training, reward

    def build(self, first: RolloutResult, batch_size: int, more: DrawMore) -> Batch:
        """The batch of `first` (the step's sampled groups), refilled by `more`."""
        rounds, shaped, refs, kl = [first], [], {}, [0.0, 0]
        shaped += self._shaped(first, refs, kl)
        keep = signal(shaped, first.dropped)
        refill_seconds, t = 0.0, self.training
        while t.refill and (k := to_draw(sum(keep), batch_size, len(rounds) - 1,
                                         t.max_refill_rounds)):
            start = time.perf_counter()
            extra = self._more(more, len(rounds), k, sum(len(r.groups) for r in rounds))
            refill_seconds += time.perf_counter() - start
            rounds.append(extra)
            extra_shaped = self._shaped(extra, refs, kl)
            shaped += extra_shaped
            keep += signal(extra_shaped, extra.dropped)
        result = merged(rounds)
        a = self.algorithm
        if t.refill:
            advantages = kept_advantages(shaped, keep, a.advantage, a.std_scale)
        else:
            advantages = compute_advantages(shaped, a.advantage, a.std_scale)
        advantages, divisor = bounded_for_loss(advantages)  # float32-safe, order kept
        groups = [[self._datum(e, adv, refs) for e, adv in zip(group, advs, strict=True)
                   if adv != 0.0]
                  for group, advs, dropped in zip(result.groups, advantages, result.dropped,
                                                  strict=True) if not dropped]
        metrics = self._metrics(result, rounds, kl, groups)
        return Batch(result, result.rewards(), advantages, groups, divisor, metrics,
                     refill_seconds)

    def _more(self, more: DrawMore, refill_round: int, k: int, drawn: int) -> RolloutResult:
        """A refill round; the host's failures and errors of the step's earlier rounds are
        kept (the host counts them per rollout)."""
        host = self.host
        failures, errors = host.failures, list(host.errors)
        extra = more(refill_round, k, drawn)
        host.failures, host.errors = host.failures + failures, errors + list(host.errors)
        return extra

    def _shaped(self, result: RolloutResult, refs: dict, kl: list) -> list[list[float]]:
        """The round's rewards, shaped; the reference log-probs of its episodes go in
        `refs` (by episode) and the KL's (sum, tokens) in `kl`."""
        shaped = result.rewards()
        r, t, a = self.reward, self.training, self.algorithm
        if r.overlong_buffer:
            shaped = [[x + overlong_penalty(e.ledger.sampled_tokens, t.max_tokens,
                                            r.overlong_buffer, r.overlong_penalty)
                       for x, e in zip(xs, g, strict=True)]
                      for xs, g in zip(shaped, result.groups, strict=True)]
        if a.kl_coef:
            per_episode = self._kl(result, refs)
            kl[0] += sum(s for s, _ in per_episode.values())
            kl[1] += sum(n for _, n in per_episode.values())
            if a.kl_in == "reward":
                shaped = [[x - a.kl_coef * per_episode.get(id(e), (0.0, 0))[0]
                           for x, e in zip(xs, g, strict=True)]
                          for xs, g in zip(shaped, result.groups, strict=True)]
        return shaped

    def _kl(self, result: RolloutResult, refs: dict) -> dict[int, tuple[float, int]]:
        """Each sampled episode's KL to the base model: (sum over its tokens, tokens), from
        the sampler's log-probs and one forward of the base model (the reference)."""
        episodes = [e for g in result.groups for e in g if any(e.ledger.mask)]
        if not episodes:
            return {}
        datums = [episode_datum(e, 0.0) for e in episodes]
        ref = self.backend.reference_logprobs(datums, self.training.temperature)
        out = {}
        for e, d, lps in zip(episodes, datums, ref, strict=True):
            refs[id(e)] = lps
            out[id(e)] = sequence_kl(d.logprobs, lps, d.mask, self.algorithm.kl_estimator)
        return out

    def _datum(self, e: Episode, advantage: float, refs: dict) -> Datum:
        d = episode_datum(e, advantage)
        if self.algorithm.kl_coef and self.algorithm.kl_in == "loss":
            d.ref_logprobs = refs[id(e)]
        return d

    def _metrics(self, result: RolloutResult, rounds: list[RolloutResult], kl: list,
                 groups: list[list[Datum]]) -> dict:
        out: dict = {}
        if self.training.refill:
            out.update(prompts_drawn=len(result.groups), refill_rounds=len(rounds) - 1,
                       trained_groups=sum(map(bool, groups)))
        if self.algorithm.kl_coef:
            out["kl"] = kl[0] / kl[1] if kl[1] else 0.0
        if self.reward.overlong_buffer:
            t, r = self.training, self.reward
            pens = [overlong_penalty(e.ledger.sampled_tokens, t.max_tokens, r.overlong_buffer,
                                     r.overlong_penalty) for g in result.groups for e in g]
            out["overlong_penalty"] = sum(pens) / max(1, len(pens))
        return out


def merged(rounds: list[RolloutResult]) -> RolloutResult:
    """One result of several sampling rounds; later rounds' groups and episodes numbered
    after the earlier ones."""
    if len(rounds) == 1:
        return rounds[0]
    groups, dropped = [], []
    for r in rounds:
        for g in r.groups:
            for e in g:
                e.group, e.id = len(groups), len(groups) * len(g) + e.id % max(1, len(g))
            groups.append(g)
        dropped += r.dropped
    return RolloutResult(groups, dropped, sum(r.env_seconds for r in rounds),
                         sum(r.bridges for r in rounds))

"""How a call is split over ranks and joined: blocks cover the call in order, sampling splits
only where the draws do not depend on the split (and then both samplers draw alike), and the
shares' loss outputs join into the whole call's."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from retrain.backends.base import LossOutput, SamplingParams
from retrain.backends.local.backend import LocalBackend
from retrain.config.sections import from_dict
from retrain.distributed.shares import blocks, joined_loss, shardable, split_params


@given(st.integers(0, 200), st.integers(1, 16))
def test_blocks_cover_the_call_in_order_and_differ_by_at_most_one(n, world):
    cut = blocks(n, world)
    assert len(cut) == world and [i for b in cut for i in b] == list(range(n))
    assert max(map(len, cut)) - min(map(len, cut)) <= 1


def test_only_per_prompt_seeds_or_greedy_split():
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    assert not shardable(params)
    assert shardable(replace(params, temperature=0.0))
    keyed = replace(params, prompt_seeds=(5, 6, 7))
    assert shardable(keyed) and split_params(keyed, range(1, 3)).prompt_seeds == (6, 7)


@pytest.mark.parametrize("sampler", ["exact", "fast"])
def test_a_split_call_samples_what_the_whole_call_does(tiny_model, sampler):
    cfg = from_dict({"model": {"name": tiny_model, "dtype": "float32", "device": "cpu",
                               "threads": 1}, "backend": {"sampler": sampler},
                     "training": {"max_tokens": 64}})
    backend = LocalBackend.from_config(cfg.model, cfg.training, cfg.backend)
    prompts = [[1, 5, 9], [1, 7], [1, 4, 4, 2], [1, 8, 3]]
    params = SamplingParams(max_tokens=10, temperature=1.0, prompt_seeds=(11, 12, 13, 14))
    whole = backend.sample(prompts, 3, params)
    parts = [g for b in blocks(len(prompts), 3)
             for g in backend.sample(prompts[b.start:b.stop], 3, split_params(params, b))]
    assert [[c.tokens for c in g] for g in parts] == [[c.tokens for c in g] for g in whole]
    assert len({tuple(c.tokens) for g in whole for c in g}) > 4  # the draws differ


def test_shares_join_into_the_whole_call():
    a = LossOutput(loss=0.25, logprobs=[[-1.0], [-2.0]],
                   metrics={"tokens": 3.0, "clip_fraction": 0.0, "ratio_mean": 1.0,
                            "ratio_max": 1.5, "kl": 0.3, "grad_micro_batches": 1.0})
    b = LossOutput(loss=-0.5, logprobs=[[-3.0]],
                   metrics={"tokens": 1.0, "clip_fraction": 1.0, "ratio_mean": 2.0,
                            "ratio_max": 2.5, "kl": 0.7, "grad_micro_batches": 1.0})
    out = joined_loss([a, b], [3, 1])
    assert out.loss == -0.25 and out.logprobs == [[-1.0], [-2.0], [-3.0]]
    assert out.metrics["tokens"] == 4.0 and out.metrics["grad_micro_batches"] == 2.0
    assert out.metrics["clip_fraction"] == pytest.approx(0.25)
    assert out.metrics["ratio_mean"] == pytest.approx(1.25)
    assert out.metrics["kl"] == pytest.approx(0.4) and out.metrics["ratio_max"] == 2.5
    assert "grad_small_sq_norm" not in out.metrics  # no rank measured micro-batches


def test_micro_batch_measurements_join_over_the_ranks_that_took_them():
    measured = {"tokens": 4.0, "grad_micro_batches": 2.0, "grad_small_sq_norm": 3.0,
                "grad_small_tokens": 2.0, "grad_big_sq_norm": 9.0, "grad_coherence": 0.5}
    out = joined_loss([LossOutput(0.0, [], measured),
                       LossOutput(0.0, [], {**measured, "grad_small_sq_norm": 6.0,
                                            "grad_coherence": 0.1})], [4, 4])
    assert out.metrics["grad_micro_batches"] == 4.0
    assert out.metrics["grad_small_sq_norm"] == pytest.approx(4.5)
    assert out.metrics["grad_big_sq_norm"] == 9.0 and out.metrics["grad_big_tokens"] == 8.0
    assert out.metrics["grad_coherence"] == pytest.approx(0.3)

"""Gradient noise scale, statistical efficiency, goodput bound and step-cost estimates (pure)."""

from __future__ import annotations

import math
import random
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrain.control.goodput import goodput_batch, statistical_efficiency
from retrain.control.gradnoise import GradStats, NoiseScale, two_batch_estimates
from retrain.control.stepcost import (
    ModelCost,
    StepCost,
    decode_cost,
    prefill_cost,
    sample_cost,
    step_cost,
    train_cost,
)
from retrain.control.usl import UslFit

FAST = settings(max_examples=200, deadline=None)


def expected_stats(g2: float, trace: float, sizes: list[float]) -> GradStats:
    """The expectations E|g_i|² = |G|² + S/B_i and E|G_big|² = |G|² + S/B_big, exactly."""
    small = sum(g2 + trace / b for b in sizes) / len(sizes)
    hm = len(sizes) / sum(1 / b for b in sizes)
    return GradStats(len(sizes), small, hm, g2 + trace / sum(sizes), float(sum(sizes)), None)


@FAST
@given(st.floats(1e-6, 1e3), st.floats(1e-6, 1e6),
       st.lists(st.integers(1, 5000), min_size=2, max_size=16))
def test_the_estimator_inverts_the_expectations(g2, trace, sizes):
    stats = expected_stats(g2, trace, sizes)
    got_g2, got_trace = two_batch_estimates(stats)
    assert got_g2 == pytest.approx(g2, rel=1e-6, abs=1e-9 * trace)
    # The trace is a difference of two squared norms of size ~g2 over 1/B_small - 1/B_big:
    # float64 rounding alone is ~eps * g2 / that gap (g2 512, trace 1e-6 is off by 1e-12).
    gap = 1 / stats.small_tokens - 1 / stats.big_tokens
    rounding = 64 * sys.float_info.epsilon * (g2 + trace) / gap
    assert got_trace == pytest.approx(trace, rel=1e-6, abs=rounding)


def test_the_estimator_is_unbiased_on_sampled_gradients():
    """Per-token gradients G + noise (per-coordinate variance v): B_simple = d v / |G|²."""
    rng, d, v, mean = random.Random(1), 20, 4.0, [0.3] * 20
    true = d * v / sum(m * m for m in mean)
    scale = NoiseScale(decay=0.999)
    for _ in range(400):
        sizes = [rng.randint(20, 60) for _ in range(4)]
        grads = [[m + rng.gauss(0, math.sqrt(v / b)) for m in mean] for b in sizes]
        whole = [sum(g[i] * b for g, b in zip(grads, sizes, strict=True)) / sum(sizes)
                 for i in range(d)]
        k = len(sizes)
        stats = GradStats(k, sum(sum(x * x for x in g) for g in grads) / k,
                          k / sum(1 / b for b in sizes), sum(x * x for x in whole),
                          float(sum(sizes)), None)
        scale.update(stats)
    assert scale.value == pytest.approx(true, rel=0.15)


def test_a_single_micro_batch_or_no_measurement_gives_none():
    assert GradStats.from_metrics({}) is None                         # Tinker: nothing measured
    assert GradStats.from_metrics({"grad_micro_batches": 1.0}) is None
    scale = NoiseScale()
    assert scale.update(None) is None and scale.value is None
    stats = GradStats.from_metrics({"grad_micro_batches": 2, "grad_small_sq_norm": 2.0,
                                    "grad_small_tokens": 10.0, "grad_big_sq_norm": 1.5,
                                    "grad_big_tokens": 20.0, "grad_coherence": 0.5})
    assert stats is not None and scale.update(stats) == pytest.approx(10.0)   # S=10, |G|²=1
    again = NoiseScale()
    again.load_state_dict(scale.state_dict())
    assert again.value == scale.value


def test_an_unresolved_mean_gradient_is_none_not_a_negative_scale():
    noisy = GradStats(2, 1.0, 10.0, 0.4, 20.0, None)        # |G|² estimate < 0
    assert two_batch_estimates(noisy)[0] < 0 and NoiseScale().update(noisy) is None


@FAST
@given(st.floats(0.0, 1e4), st.integers(1, 512), st.integers(1, 512))
def test_efficiency_is_one_at_the_base_batch_and_falls_with_size(phi, b, b0):
    assert statistical_efficiency(phi, b0, b0) == pytest.approx(1.0)
    e = statistical_efficiency(phi, b, b0)
    assert (e <= 1.0 + 1e-12) if b >= b0 else (e >= 1.0 - 1e-12)
    assert statistical_efficiency(phi, b + 1, b0) < e
    # Progress per step (e x b, in base-batch steps) grows with the batch but never faster
    # than the batch itself: a larger batch never loses progress per step, nor gains per example.
    assert (e * b >= b0 * (1 - 1e-9)) if b >= b0 else (e * b <= b0 * (1 + 1e-9))


@FAST
@given(st.floats(0.0, 0.5), st.floats(1e-7, 1e-3), st.floats(1e-3, 1e4), st.integers(1, 32))
def test_goodput_batch_never_exceeds_the_fastest_batch(sigma, kappa, phi, b0):
    fit, g = UslFit(sigma, kappa, 100.0), 8
    best = goodput_batch(fit, g, 1, 64, phi, b0)
    fastest = max(range(1, 65), key=lambda b: fit.throughput(b * g))
    assert 1 <= best <= fastest
    assert goodput_batch(fit, g, 1, 64, 1e12, b0) == fastest      # all noise: speed alone


def test_goodput_prefers_small_batches_when_the_gradient_is_clean():
    saturating = UslFit(0.1, 0.0, 100.0)   # no peak: throughput grows to the largest batch
    assert goodput_batch(saturating, 8, 1, 64, 1e-3, 8) == 1   # but bigger batches add nothing
    assert goodput_batch(saturating, 8, 1, 64, 1e6, 8) == 64
    assert 1 < goodput_batch(saturating, 8, 1, 64, 8.0, 8) < 64


def test_step_cost_counts_by_hand():
    m = ModelCost(parameters=1000, weight_bytes=4000, kv_bytes_per_token=10)
    c = step_cost(m, [5], [[2, 3]], trained_tokens=5, micro_batches=2)
    # the prompt is prefilled once (5 tokens), then 2 + 3 sampled tokens
    assert c.flops == 2 * 1000 * (5 + 5) + 4 * 1000 * 5
    # passes: prefill + 3 decode steps + 2 per micro-batch; cached: (2*5+1) + (3*5+3)
    assert c.bytes_moved == 4000 * (1 + 3 + 4) + 10 * (11 + 18)


def test_phase_costs_split_body_and_lm_head():
    m = ModelCost(parameters=1300, weight_bytes=4000, kv_bytes_per_token=10,
                  body_parameters=1000, head_parameters=200)
    # prompts through the body, logits only at their last position
    assert prefill_cost(m, [5, 7]).flops == 2 * 1000 * 12 + 2 * 200 * 2
    assert decode_cost(m, [5, 7], [[2], [3, 1]]).flops == 2 * 1200 * 6
    assert sample_cost(m, [5], [[2]]) == prefill_cost(m, [5]) + decode_cost(m, [5], [[2]])
    t = train_cost(m, trained_tokens=6, micro_batches=3, prefix_tokens=4)
    assert t.flops == 4 * 1200 * 6 + 4 * 1000 * 4 and t.bytes_moved == 4000 * 6
    assert train_cost(m, 0, 0) == StepCost(0.0, 0.0)

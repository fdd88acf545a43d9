"""`[algorithm] loss_aggregation`: the one normaliser (algorithms/aggregation.py), its place in
the local backend's training pass, and the tinker backend's folding of it into the advantages:
the same datums and loss give the same losses, log-probs and gradients locally and through
`retrain serve` driven by the real tinker SDK."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrain.algorithms.aggregation import AGGREGATIONS, SUM, normaliser

settings.register_profile("retrain", deadline=None, max_examples=200)
settings.load_profile("retrain")

counts = st.lists(st.integers(0, 50), min_size=1, max_size=12).filter(any)


# ------------------------------------------------------------------ the normaliser (pure)


@given(tokens=counts, max_tokens=st.integers(1, 100))
def test_each_aggregation_is_its_definition(tokens, max_tokens):
    n, seqs = sum(tokens), sum(1 for t in tokens if t)
    scales = {how: [normaliser(tokens, how, max_tokens).scale(i) for i in range(len(tokens))]
              for how in (*AGGREGATIONS, SUM)}
    for i, t in enumerate(tokens):
        assert scales["token_mean"][i] == pytest.approx(1 / n)
        assert scales["sequence_mean"][i] == pytest.approx(1 / (seqs * t) if t else 0.0)
        assert scales["constant"][i] == pytest.approx(1 / (max_tokens * seqs))
        assert scales[SUM][i] == 1.0
    # token_mean and sequence_mean weigh the call's tokens to a total of one
    for how in ("token_mean", "sequence_mean"):
        assert sum(s * t for s, t in zip(scales[how], tokens, strict=True)) == pytest.approx(1)


@given(tokens=counts)
def test_sequences_of_one_length_make_sequence_mean_the_token_mean(tokens):
    same = [max(tokens) if t else 0 for t in tokens]
    a, b = normaliser(same, "token_mean"), normaliser(same, "sequence_mean")
    for i in range(len(same)):
        assert math.isclose(a.scale(i) if same[i] else 0.0, b.scale(i), rel_tol=1e-12)


def test_token_mean_keeps_the_plain_mean_and_bad_input_is_named():
    norm = normaliser([3, 0, 5], "token_mean")
    assert norm.weights == (1.0, 1.0, 1.0) and norm.denominator == 8.0
    with pytest.raises(ValueError, match="max_tokens"):
        normaliser([3], "constant", 0)
    with pytest.raises(ValueError, match="token_mean"):
        normaliser([3], "token-mean")


# ------------------------------------------------------------------ the local backend


@pytest.fixture(scope="module")
def setup(tiny_model):
    """The tiny model, one adapter, and off-policy datums of unequal lengths."""
    torch = pytest.importorskip("torch")
    from retrain.backends.base import Completion, SamplingParams, make_datum
    from retrain.backends.local.backend import LocalBackend
    from retrain.backends.local.model import LocalModel

    model = LocalModel.load(tiny_model, "float32", "cpu", 1)
    backend = LocalBackend.new_adapter(model, "agg", 4, 16.0, 0.0, [], seed=11)
    prompt = model.tokenizer.encode("ab")
    groups = backend.sample([prompt, prompt[:1]], 3, SamplingParams(max_tokens=6, seed=2))
    gen = torch.Generator().manual_seed(0)
    datums = []
    for i, (p, g) in enumerate(zip([prompt, prompt[:1]], groups, strict=True)):
        for j, c in enumerate(g):
            k = 2 + j + 2 * i   # cut: completions of several lengths
            d = make_datum(p, Completion(c.tokens[:k], c.logprobs[:k], "length"),
                           (-1.0) ** j + 0.25 * i)
            noise = (torch.rand(len(d.logprobs), generator=gen) - 0.5) * 0.6
            d.logprobs = [lp + float(e) * m for lp, e, m in zip(d.logprobs, noise, d.mask,
                                                                strict=True)]
            datums.append(d)
    assert len({sum(d.mask) for d in datums}) > 1, "want completions of several lengths"
    return model, backend, datums


def _grads(backend, datums, loss):
    out = backend.forward_backward(datums, loss)
    grads = [p.grad.detach().clone() for p in backend.params.values()]
    backend._zero_grad()
    return out, grads


@pytest.mark.parametrize("how", AGGREGATIONS)
def test_the_local_loss_is_the_plain_weighted_sum(setup, how):
    from retrain.backends.base import LossConfig

    _, backend, datums = setup
    loss = LossConfig("importance_sampling", aggregation=how, max_tokens=9)
    out, _ = _grads(backend, datums, loss)
    lengths = [sum(d.mask) for d in datums]
    want = 0.0
    for d, lps, n in zip(datums, out.logprobs, lengths, strict=True):
        scale = {"token_mean": 1 / sum(lengths), "sequence_mean": 1 / (len(datums) * n),
                 "constant": 1 / (9 * len(datums))}[how]
        want += sum(-math.exp(lp - q) * a * scale for lp, q, a, m in
                    zip(lps, d.logprobs, d.advantages, d.mask, strict=True) if m)
    assert out.loss == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_gradients_follow_the_normaliser(setup):
    """constant = token_mean x N / (max_tokens x sequences); sequence_mean = the mean of each
    sequence's own token-mean gradient; micro-batches change nothing."""
    import torch

    from retrain.backends.base import LossConfig

    _, backend, datums = setup
    n = sum(sum(d.mask) for d in datums)
    _, token = _grads(backend, datums, LossConfig("ppo", aggregation="token_mean"))
    _, const = _grads(backend, datums, LossConfig("ppo", aggregation="constant", max_tokens=9))
    for a, b in zip(token, const, strict=True):
        torch.testing.assert_close(b, a * n / (9 * len(datums)), rtol=1e-4, atol=1e-7)
    _, seq = _grads(backend, datums, LossConfig("ppo", aggregation="sequence_mean"))
    alone = [_grads(backend, [d], LossConfig("ppo"))[1] for d in datums]
    for k, g in enumerate(seq):
        torch.testing.assert_close(g, sum(a[k] for a in alone) / len(datums), rtol=1e-4,
                                   atol=1e-7)
    backend.micro_batch_size = 1
    try:
        _, split = _grads(backend, datums, LossConfig("ppo", aggregation="sequence_mean"))
    finally:
        backend.micro_batch_size = 0
    for a, b in zip(seq, split, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------------ local == serve (real SDK)


@pytest.mark.parametrize("name, knobs", [
    ("importance_sampling", {}), ("ppo", {"clip_eps_high": 0.1}), ("cispo", {}),
    ("gspo", {"clip_eps": 0.05, "clip_eps_high": 0.05}), ("cross_entropy", {})])
def test_local_and_serve_give_the_same_losses_logprobs_and_gradients(
        setup, name, knobs, tmp_path, sdk_env, tiny_model):
    import numpy as np
    import torch

    from retrain.backends.base import LossConfig
    from retrain.backends.local.model import LocalModel
    from retrain.backends.tinker.backend import TinkerBackend
    from retrain.serve.local_engine import LocalEngine
    from tests.serve_doubles import Served

    _, local, datums = setup
    engine = LocalEngine(LocalModel.load(tiny_model, "float32", "cpu", 1), "tiny-random")
    with Served(engine, tmp_path, hold_s=2.0) as served:
        remote = TinkerBackend(base_model="tiny-random", lora_rank=4, seed=11,
                               base_url=served.url, request_timeout_s=60)
        for how in AGGREGATIONS:
            loss = LossConfig(name, aggregation=how, max_tokens=9, **knobs)
            want, want_grads = _grads(local, datums, loss)
            got = remote.forward_backward(datums, loss)
            assert got.loss == pytest.approx(want.loss, rel=1e-4, abs=1e-6), how
            for d, a, b in zip(datums, want.logprobs, got.logprobs, strict=True):
                masked = [(x, y) for x, y, m in zip(a, b, d.mask, strict=True) if m]
                np.testing.assert_allclose(*zip(*masked, strict=True), atol=1e-5)
            trainer = next(iter(engine._backends.values()))    # serve's adapter, in process
            got_grads = [p.grad.detach().clone() for p in trainer.params.values()]
            trainer._zero_grad()
            for a, b in zip(want_grads, got_grads, strict=True):
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
        remote.close()

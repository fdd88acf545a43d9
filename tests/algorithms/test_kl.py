"""KL to the base model: the estimators (pure), the local backend's reference (the adapter
disabled) and KL term in the loss, and a run with kl_coef > 0 on the tiny model."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from retrain.algorithms.kl import sequence_kl, token_kl

logp = st.floats(-30, 0)


@given(logp, logp)
def test_the_estimators_are_their_formulas(p, q):
    assert token_kl(p, q, "k1") == pytest.approx(p - q, abs=1e-12)
    assert token_kl(p, q, "k3") == pytest.approx(math.exp(q - p) - 1 - (q - p), rel=1e-9,
                                                  abs=1e-12)
    assert token_kl(p, q, "k3") >= -1e-15  # k3 is never negative (up to rounding)
    assert token_kl(p, p, "k1") == token_kl(p, p, "k3") == 0.0


def test_sequence_kl_counts_only_the_masked_tokens():
    assert sequence_kl([-1.0, -2.0, -3.0], [-1.5, -9.0, -2.0], [1, 0, 1], "k1") == \
        pytest.approx((0.5 + -1.0, 2))
    with pytest.raises(ValueError, match="k2"):
        token_kl(0.0, 0.0, "k2")


# ---------------------------------------------------------------------------- local backend

def _backend_and_datums(tiny_model, tmp_path):
    pytest.importorskip("torch")
    from retrain.backends.base import SamplingParams, make_datum
    from retrain.backends.local.backend import LocalBackend
    from retrain.backends.local.model import LocalModel

    model = LocalModel.load(tiny_model, "float32", "cpu", 1)
    backend = LocalBackend.new_adapter(model, "kl", lora_rank=4, seed=7, checkpoint_dir=tmp_path)
    prompt = model.tokenizer("what is 2 + 2?")["input_ids"]
    [group] = backend.sample([prompt], 4, SamplingParams(max_tokens=6, seed=1))
    return backend, [make_datum(prompt, c, (-1.0) ** j) for j, c in enumerate(group)]


def test_the_reference_is_the_base_and_the_loss_adds_the_kl(tiny_model, tmp_path):
    from retrain.backends.base import AdamParams, LossConfig

    backend, datums = _backend_and_datums(tiny_model, tmp_path)
    # before any update the adapter is the identity: reference == policy, bit for bit
    assert backend.reference_logprobs(datums) == backend.logprobs(datums)
    backend.forward_backward(datums, LossConfig())
    backend.optim_step(AdamParams(learning_rate=5e-2))
    policy, ref = backend.logprobs(datums), backend.reference_logprobs(datums)
    assert max(abs(a - b) for p, r in zip(policy, ref, strict=True)
               for a, b in zip(p, r, strict=True)) > 1e-3  # the adapter was really disabled
    for d, r in zip(datums, ref, strict=True):
        d.ref_logprobs = r
    plain = backend.forward_backward(datums, LossConfig(name="ppo"))
    backend._zero_grad()
    coef = 0.5
    with_kl = backend.forward_backward(datums, LossConfig(name="ppo", kl_coef=coef,
                                                          kl_estimator="k3"))
    backend._zero_grad()
    total = sum(sequence_kl(lp, r, d.mask, "k3")[0]
                for lp, r, d in zip(with_kl.logprobs, ref, datums, strict=True))
    tokens = sum(sum(d.mask) for d in datums)
    assert with_kl.metrics["kl"] == pytest.approx(total / tokens, rel=1e-4, abs=1e-7)
    assert with_kl.loss - plain.loss == pytest.approx(coef * total / tokens, rel=1e-4, abs=1e-6)
    assert total > 0


# ---------------------------------------------------------------------------- a run

@pytest.mark.parametrize("kl_in", ["reward", "loss"])
def test_kl_is_zero_at_step_one_and_grows(tmp_path, monkeypatch, tiny_model, kl_in):
    pytest.importorskip("torch")
    from retrain.config.loader import load_config
    from retrain.run.single import run_single
    from tests.run_helpers import rows, write_config

    monkeypatch.chdir(tmp_path)
    path = write_config(tmp_path, algorithm={"kl_coef": 0.05, "kl_in": kl_in,
                                             "kl_estimator": "k3"},
                        training={"max_steps": 4, "lr": 5e-2}, data={"eval_size": 0})
    assert run_single(load_config(path, {}), path) == 0
    kl = [r["kl"] for r in rows(tmp_path / "logs" / "run")]
    # step 1 samples from the untrained adapter (= the base): only the sampler's and the
    # trainer's float rounding separate them
    assert abs(kl[0]) < 1e-5
    assert kl[-1] > 1e-3 and kl[-1] > 100 * abs(kl[0])


def test_tinker_reference_is_the_base_models_compute_logprobs(tiny_server, sdk_env,
                                                              tiny_model):
    """Through `retrain serve` and the real tinker SDK: before any update the reference is the
    policy the sampler drew from; after updates it stays where it was (the base model)."""
    pytest.importorskip("tinker")
    from retrain.backends.base import AdamParams, LossConfig, SamplingParams, make_datum
    from retrain.backends.tinker.backend import TinkerBackend

    backend = TinkerBackend(base_model="tiny-random", lora_rank=4, seed=5,
                            base_url=tiny_server.url, request_timeout_s=60)
    prompt = backend.tokenizer("what is 2 + 2?")["input_ids"]
    [group] = backend.sample([prompt], 4, SamplingParams(max_tokens=6, seed=1))
    datums = [make_datum(prompt, c, (-1.0) ** j) for j, c in enumerate(group)]
    before = backend.reference_logprobs(datums)
    for d, ref in zip(datums, before, strict=True):
        assert [r for r, m in zip(ref, d.mask, strict=True) if m] == \
            pytest.approx([lp for lp, m in zip(d.logprobs, d.mask, strict=True) if m], abs=1e-4)
        assert all(r == 0.0 for r, m in zip(ref, d.mask, strict=True) if not m)
    for _ in range(2):
        backend.forward_backward(datums, LossConfig())
        backend.optim_step(AdamParams(learning_rate=5e-2))
    after = backend.reference_logprobs(datums)
    assert sum(after, []) == pytest.approx(sum(before, []), abs=1e-5)
    [moved] = backend.sample([prompt], 4, SamplingParams(max_tokens=6, seed=1))
    assert sum((c.logprobs for c in moved), []) != \
        pytest.approx(sum((c.logprobs for c in group), []), abs=1e-3)  # the policy did move
    backend.close()


def test_kl_in_the_loss_reaches_the_backends_loss_config():
    """kl_in = "loss" hands kl_coef to the backend's loss; "reward" leaves the loss alone."""
    from retrain.config.sections import Config
    from retrain.run.update import loss_config

    cfg = Config()
    cfg.algorithm.kl_coef, cfg.algorithm.kl_estimator = 0.1, "k3"
    cfg.algorithm.kl_in = "loss"
    loss = loss_config(cfg.algorithm, cfg.training)
    assert (loss.kl_coef, loss.kl_estimator) == (0.1, "k3")
    cfg.algorithm.kl_in = "reward"
    assert loss_config(cfg.algorithm, cfg.training).kl_coef == 0.0

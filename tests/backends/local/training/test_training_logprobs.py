"""The LM head in chunks (training/logprobs.py): the log-probs and gradients of all rows at
once, while no more than one chunk's logits exist, in the forward or the backward."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from retrain.backends.local.sampling.exact import token_logprobs  # noqa: E402
from retrain.backends.local.training.logprobs import (  # noqa: E402
    Head,
    chunk_rows,
    chunked_logprobs,
)

settings.register_profile("retrain", deadline=None, max_examples=200)
settings.load_profile("retrain")

VOCAB, HIDDEN = 97, 16


def setup(n: int, seed: int):
    """A head (trained, as in full fine-tuning), n hidden states, targets, loss weights."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=gen) * 0.2)  # the tiny model's
    hidden = torch.randn(n, HIDDEN, generator=gen, requires_grad=True)
    targets = torch.randint(0, VOCAB, (n,), generator=gen)
    weights = torch.randn(n, generator=gen)
    return head, hidden, targets, weights


def value_and_grads(head, hidden, targets, weights, temperature, rows=None):
    if rows is None:
        lp = token_logprobs(head(hidden), temperature).gather(-1, targets[:, None])[:, 0]
    else:
        lp = chunked_logprobs(head, hidden, targets, temperature, rows)
    (lp * weights).sum().backward()
    out = (lp.detach(), hidden.grad.clone(), head.weight.grad.clone())
    hidden.grad, head.weight.grad = None, None
    return out


@given(n=st.integers(1, 40), rows=st.integers(1, 50), seed=st.integers(0, 2**16),
       temperature=st.sampled_from([0.3, 0.7, 1.0, 1.6]))
def test_chunks_give_the_log_probs_and_gradients_of_one_pass(n, rows, seed, temperature):
    head, hidden, targets, weights = setup(n, seed)
    want = value_and_grads(head, hidden, targets, weights, temperature)
    got = value_and_grads(head, hidden, targets, weights, temperature, rows)
    for a, b in zip(got, want, strict=True):  # to 1e-6 of the largest entry where above 1
        torch.testing.assert_close(a, b, rtol=0.0, atol=1e-6 * max(1.0, float(b.abs().max())))


def test_no_chunk_of_logits_outlives_its_turn():
    """What the forward saves for the backward is the hidden states, not the logits; every
    call of the head (the forward's, the backward's again) makes one chunk's logits."""
    n, rows = 40, 7
    head, hidden, targets, weights = setup(n, seed=3)
    made: list[int] = []
    head.register_forward_hook(lambda _m, _i, out: made.append(out.numel()))
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp = chunked_logprobs(head, hidden, targets, 1.0, rows)
    forward_calls = len(made)
    (lp * weights).sum().backward()
    assert forward_calls == -(-n // rows) and len(made) == 2 * forward_calls  # recomputed
    assert max(made) == rows * VOCAB
    assert max(saved) < rows * VOCAB  # neither logits nor log-probs kept between passes
    assert hidden.grad is not None and head.weight.grad is not None


def test_one_chunk_is_the_plain_computation_and_no_grad_recomputes_nothing():
    head, hidden, targets, _ = setup(10, seed=4)
    calls: list[int] = []
    head.register_forward_hook(lambda _m, _i, out: calls.append(1))
    chunked_logprobs(head, hidden, targets, 1.0, 10).sum().backward()
    assert len(calls) == 2 - 1  # one pass, nothing to recompute
    with torch.no_grad():
        chunked_logprobs(head, hidden, targets, 1.0, 3)
    assert len(calls) == 1 + 4


def test_chunk_rows_hold_the_entries():
    assert chunk_rows(49152) == 2**26 // 49152 == 1365
    assert chunk_rows(10**9) == 1
    assert chunk_rows(100, entries=250) == 2


def test_a_plain_head_runs_the_body_and_others_the_models_forward(model):
    head = Head(model.net)
    assert head.chunked and head.body is model.base.model
    assert head.lm_head is model.base.lm_head
    assert not Head(model.net, model_forward=True).chunked
    ids = torch.tensor([[5, 6, 7, 8]])
    keep = torch.tensor([[False, True, False, True]])
    with torch.no_grad():
        logits = model.net(input_ids=ids).logits[keep]
        hidden = head.kept(keep, input_ids=ids)
        torch.testing.assert_close(head.lm_head(hidden), logits)
        torch.testing.assert_close(Head(model.net, model_forward=True).kept(keep, input_ids=ids),
                                   logits)


@pytest.fixture
def compiling(tiny_model, monkeypatch):
    """A packed-layout adapter whose training forward goes through torch.compile with the
    `eager` backend: dynamo's capture and guards as on a GPU, without minutes of inductor."""
    import torch._dynamo

    from retrain.backends.local.model import LocalModel
    from tests.training_models import adapter

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "eager"}))
    model = LocalModel.load(tiny_model, "float32", "cpu", 1)
    backend = adapter(model, "compiled")
    backend.layout = "packed"
    yield backend
    torch._dynamo.reset()


def test_the_compiled_forward_trains_as_the_eager_one_and_new_shapes_do_not_recompile(
        compiling):
    import torch._dynamo

    from retrain.backends.base import LossConfig
    from tests.training_models import random_datums

    backend, loss = compiling, LossConfig("ppo", temperature=0.8)
    datums = random_datums(backend.model.vocab_size)

    def step(ds):
        out = backend.forward_backward(ds, loss)
        grads = [p.grad.clone() for p in backend.params.values()]
        backend._zero_grad()
        return out, grads

    eager = step(datums)
    backend.compile_training = True
    compiled = step(datums)
    assert compiled[0].loss == pytest.approx(eager[0].loss, rel=1e-6)
    for a, b in zip(compiled[1], eager[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    body = Head(backend.model.net, compile=True).body
    assert body.failed is None
    other = random_datums(backend.model.vocab_size, seed=5, lengths=((7, 2, 12), (8, 4, 6)),
                          prompt_lengths=(4, 2))
    with torch._dynamo.config.patch(error_on_recompile=True):
        step(other)   # other rows and row lengths: the dynamic shapes take them
    assert body.failed is None


def test_a_compile_that_fails_costs_one_line_and_runs_eagerly(tiny_model, monkeypatch,
                                                              capsys):
    from retrain.backends.base import LossConfig
    from retrain.backends.local.model import LocalModel
    from tests.training_models import adapter, random_datums

    def broken(fn, **kw):
        def call(**forward):
            raise RuntimeError("InductorError: no C++ compiler\nmore lines")
        return call

    monkeypatch.setattr(torch, "compile", broken)
    backend = adapter(LocalModel.load(tiny_model, "float32", "cpu", 1), "broken")
    backend.layout = "packed"
    datums = random_datums(backend.model.vocab_size)
    want = backend.forward_backward(datums, LossConfig())
    backend._zero_grad()
    backend.compile_training = True
    for _ in range(2):
        assert backend.forward_backward(datums, LossConfig()).loss == want.loss
        backend._zero_grad()
    err = capsys.readouterr().err
    assert err.count("compiled training forward failed") == 1
    assert "RuntimeError: InductorError: no C++ compiler)" in err

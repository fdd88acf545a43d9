"""The training pass's layouts and heads (training/forward.py, pack.py, logprobs.py) against
the path before them, the model's own forward of the prefix layout with every kept logit at
once: the same loss, log-probs and gradients to 1e-6, for every loss and several
temperatures, on a random model of SmolLM2-135M's shape in float32 and on the tiny model;
and packed rows that leak attention across sequences fail.

The tiny model runs in float64 here (the log-softmax stays float32): its large weights
(init 0.2) put float32's rounding of any two exact computations at ~1e-6 of a log-prob or
gradient, the old path against itself split into other micro-batches included (measured
under both kernel sets), which a 1e-6 test would then read as a difference."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from retrain.algorithms.losses import LOSSES  # noqa: E402
from retrain.backends.base import LossConfig  # noqa: E402
from retrain.backends.local.training import plan  # noqa: E402
from retrain.backends.local.training.logprobs import Head  # noqa: E402
from retrain.backends.local.training.pack import pack_rows  # noqa: E402
from tests.training_models import (  # noqa: E402
    adapter,
    assert_same,
    random_datums,
    run,
    smollm2_shaped,
)

TEMPERATURES = (0.7, 1.0, 1.3)
KNOBS = {"ppo": {"clip_ratio_c": 2.0}, "gspo": {"clip_eps": 0.05}, "dro": {"dro_beta": 0.3}}


@pytest.fixture(scope="module")
def tiny(tiny_model):
    """The tiny model in float64, an adapter, datums."""
    from retrain.backends.local.model import LocalModel

    model = LocalModel.load(tiny_model, "float32", "cpu", 1)
    model.base.double()
    return adapter(model, "layouts"), random_datums(model.vocab_size)


@pytest.fixture(scope="module")
def smollm2():
    """Shorter completions: its head (49,152 x 576) is most of the test's time."""
    model = smollm2_shaped(layers=2)
    datums = random_datums(model.vocab_size, seed=1, lengths=((3, 1, 6, 9), (5, 2), (1, 4)))
    return adapter(model, "layouts"), datums


def variants(vocab: int, every: bool = True) -> dict[str, dict]:
    """Each new path: chunks of 5 rows (several per micro-batch), packed rows, both, and
    packed micro-batches of 2 sequences (`every` False: the first and the last)."""
    out = {"prefix, chunked": dict(layout="prefix", entries=5 * vocab),
           "packed": dict(layout="packed"),
           "packed, chunked": dict(layout="packed", entries=5 * vocab),
           "packed, 2 a micro-batch": dict(layout="packed", entries=7 * vocab, size=2)}
    return out if every else {k: out[k] for k in ("prefix, chunked", "packed, 2 a micro-batch")}


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
@pytest.mark.parametrize("name", LOSSES)
def test_every_loss_and_temperature_gives_the_same_numbers_in_every_layout(
        which, name, request):
    backend, datums = request.getfixturevalue(which)
    for temperature in TEMPERATURES:
        loss = LossConfig(name, temperature=temperature, **KNOBS.get(name, {}))
        want = run(backend, datums, loss, "prefix", model_forward=True)
        assert want[0].metrics["tokens"] == sum(sum(d.mask) for d in datums)
        for label, how in variants(backend.model.vocab_size, which == "tiny").items():
            got = run(backend, datums, loss, **how)
            try:
                assert_same(got, want, datums)
            except AssertionError as exc:
                raise AssertionError(f"{label}, temperature {temperature}: {exc}") from exc
            assert got[0].metrics.get("clip_fraction") == pytest.approx(
                want[0].metrics.get("clip_fraction"), abs=1e-6)


def test_the_kl_term_and_sequence_mean_agree_in_every_layout(tiny):
    backend, datums = tiny
    loss = LossConfig("ppo", kl_coef=0.3, kl_estimator="k3", aggregation="sequence_mean")
    want = run(backend, datums, loss, "prefix", model_forward=True)
    for how in variants(backend.model.vocab_size).values():
        got = run(backend, datums, loss, **how)
        assert_same(got, want, datums)
        assert got[0].metrics["kl"] == pytest.approx(want[0].metrics["kl"], rel=1e-6)


def alone(backend, datums, temperature: float) -> list[list[float]]:
    """Each datum's target log-probs from a forward of that sequence by itself."""
    from retrain.backends.local.sampling.exact import token_logprobs

    net = backend.model.net
    out = []
    with torch.no_grad():
        for d in datums:
            logits = net(input_ids=torch.tensor([d.input_tokens]), use_cache=False).logits[0]
            lp = token_logprobs(logits, temperature)
            out.append(lp.gather(-1, torch.tensor(d.target_tokens)[:, None])[:, 0].tolist())
    return out


def _packed_gap(backend, datums) -> float:
    out, _ = run(backend, datums, LossConfig(temperature=0.9), "packed")
    want = alone(backend, datums, 0.9)
    return max(abs(a - b) for d, x, y in zip(datums, out.logprobs, want, strict=True)
               for a, b, m in zip(x, y, d.mask, strict=True) if m)


def test_packed_rows_hold_several_sequences_each_attending_to_itself_alone(tiny):
    backend, datums = tiny
    unit = plan.plan(datums, 0, plan.cpu_budget(), backend.model.vocab_size, packed=True)
    rows = pack_rows(datums, unit[0], backend.model.pad_id, backend.model.device)
    assert len(unit) == 1 and any(len(r) > 2 for r in rows.rows), rows.rows
    assert _packed_gap(backend, datums) < 1e-5


def test_a_cache_in_the_packed_forward_leaks_attention_and_the_comparison_catches_it(
        tiny, monkeypatch):
    """transformers 5.x finds packed sequences only without a cache: the forward passes
    use_cache=False. With a cache the rows attend across sequences, and the log-probs then
    differ from each sequence alone: the test above would fail."""
    backend, datums = tiny
    real = Head.kept

    def with_cache(self, keep, **forward):
        return real(self, keep, **{**forward, "use_cache": True})

    monkeypatch.setattr(Head, "kept", with_cache)
    assert _packed_gap(backend, datums) > 1e-3


def test_forward_only_logprobs_agree_between_layouts(tiny):
    backend, datums = tiny
    want = backend.logprobs(datums, 0.8)
    backend.layout = "packed"
    try:
        got = backend.logprobs(datums, 0.8)
    finally:
        backend.layout = "prefix"
    for d, a, b in zip(datums, got, want, strict=True):
        for x, y, m in zip(a, b, d.mask, strict=True):
            assert m == 0 or abs(x - y) <= 1e-6 * max(1.0, abs(y))


def test_full_finetuning_gets_the_head_and_embedding_gradient_through_the_chunks(tiny_model):
    from retrain.backends.local.full import FullBackend
    from retrain.backends.local.model import LocalModel

    model = LocalModel.load(tiny_model, "float32", "cpu", 1)
    model.base.double()
    backend = FullBackend(model, seed=3)
    datums = random_datums(model.vocab_size, seed=2)
    loss = LossConfig("cispo", temperature=0.8)
    want = run(backend, datums, loss, "prefix", model_forward=True)
    embed = list(backend.params).index("model.embed_tokens.weight")
    assert float(want[1][embed].abs().sum()) > 0
    for how in variants(model.vocab_size).values():
        assert_same(run(backend, datums, loss, **how), want, datums)


def test_the_cpu_layout_gives_the_old_paths_numbers_to_the_bit_in_bfloat16():
    """The CPU keeps the prefix layout with the head run bucket by bucket, as before: in
    bfloat16, where a matmul of another shape rounds logits otherwise (one matmul over all
    buckets moved the quickstart's first gradient norm by 1e-3), the same bits, so a run's
    trajectory stays the one it was."""
    model = smollm2_shaped(layers=1)
    model.base.to(torch.bfloat16)
    backend = adapter(model, "bits")
    datums = random_datums(model.vocab_size, seed=3, lengths=((2, 30, 4, 14, 7), (3, 21)),
                           prompt_lengths=(5, 4))
    loss = LossConfig("ppo", temperature=0.7)
    (out, grads), (ref, ref_grads) = (run(backend, datums, loss, "prefix", model_forward=m)
                                      for m in (False, True))
    assert out.logprobs == ref.logprobs and out.loss == ref.loss
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))

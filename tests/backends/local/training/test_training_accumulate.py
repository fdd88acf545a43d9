"""The training pass's loop (training/accumulate.py): retrain's own code reads the device
back a fixed number of times per forward_backward call, not once per micro-batch, and the
statistics it sums on the device do not depend on the split."""

from __future__ import annotations

import collections
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from retrain.backends.base import LossConfig  # noqa: E402
from retrain.backends.local.training.forward import LAYOUTS  # noqa: E402
from tests.training_models import adapter, random_datums, run  # noqa: E402

READS = ("tolist", "item", "__float__", "__int__", "__bool__", "cpu", "numpy")
LOSS = LossConfig("ppo", clip_eps=0.05, kl_coef=0.2, ratio_cap=1.2)


@pytest.fixture(scope="module")
def tiny(model):
    """Datums whose sampler log-probs are the trainer's +- 0.3: some ratios clip, some are
    cut by the cap, most do neither."""
    backend = adapter(model, "loop")
    datums = random_datums(model.vocab_size, lengths=((5, 3, 9, 14), (9, 2, 6)),
                           prompt_lengths=(6, 3))
    gen = torch.Generator().manual_seed(4)
    for d, lp in zip(datums, backend.logprobs(datums), strict=True):
        d.logprobs = [x + 0.6 * (float(torch.rand(1, generator=gen)) - 0.5) for x in lp]
    yield backend, datums
    backend.close()
    model.delete_adapter("loop")


def reads_of_retrain(monkeypatch) -> collections.Counter:
    """Every host read of a tensor (the calls in READS) made by a line of retrain/."""
    seen: collections.Counter = collections.Counter()
    for name in READS:
        real = getattr(torch.Tensor, name)

        def wrapper(self, *args, _real=real, _name=name, **kwargs):
            frame = sys._getframe(1)
            if "/retrain/" in frame.f_code.co_filename:
                seen[f"{_name} at {frame.f_code.co_filename}:{frame.f_lineno}"] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    return seen


@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_reads_do_not_grow_with_the_micro_batches(tiny, monkeypatch, layout):
    backend, datums = tiny
    counts = {}
    for size in (5, 1):  # 2 micro-batches, then one per sequence
        seen = reads_of_retrain(monkeypatch)
        out, _ = run(backend, datums, LOSS, layout, size=size)
        monkeypatch.undo()
        assert out.metrics["grad_micro_batches"] == (len(datums) if size == 1 else 2)
        counts[size] = seen
    assert counts[1] == counts[5], (counts[1], counts[5])
    assert sum(counts[1].values()) <= 6, counts[1]


def test_the_statistics_do_not_depend_on_the_split(tiny):
    backend, datums = tiny
    (one, _), (many, _) = (run(backend, datums, LOSS, "packed", size=s) for s in (0, 1))
    for key in ("clip_fraction", "ratio_mean", "ratio_max", "ratio_truncated", "kl", "tokens"):
        assert many.metrics[key] == pytest.approx(one.metrics[key], rel=1e-5), key
    assert many.metrics["grad_micro_batches"] == len(datums)
    assert 0 < one.metrics["clip_fraction"] < 1 and 0 < one.metrics["ratio_truncated"] < 1

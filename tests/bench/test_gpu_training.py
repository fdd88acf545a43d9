"""bench/gpu/training.py's arithmetic: the FLOPs its MFU divides are the matmuls the step
runs (torch's own FLOP counter), and the step it times has the issue's shape."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from bench.gpu.main import SMOKE, SMOKE_SHAPES, build  # noqa: E402
from bench.gpu.training import _full_backend, step_datums, train_flops  # noqa: E402
from retrain.backends.base import LossConfig  # noqa: E402


@pytest.mark.parametrize("name", list(SMOKE_SHAPES))
def test_the_counted_flops_are_the_matmuls_of_a_full_finetuning_step(name):
    """Full fine-tuning in packed rows: every matmul of the forward and the backward (torch's
    FlopCounterMode) is train_flops' linear and head part; attention, which the counter does
    not see on the CPU (SDPA), is the rest."""
    from torch.utils.flop_counter import FlopCounterMode

    shape = SMOKE_SHAPES[name]
    backend = _full_backend(build(shape, SMOKE, name), name)
    backend.layout = "packed"
    datums = step_datums(backend, SMOKE)
    with FlopCounterMode(display=False) as counter:
        out = backend.forward_backward(datums, LossConfig())
    lengths, kept = [len(d) for d in datums], int(out.metrics["tokens"])
    assert len(datums) == SMOKE.rl_prompts * SMOKE.group
    assert kept == len(datums) * SMOKE.new_tokens
    assert set(lengths) == {SMOKE.prompt_len + SMOKE.new_tokens - 1}
    head_dim = shape.get("head_dim", shape["hidden"] // shape["heads"])
    attention = 3 * sum(2 * shape["layers"] * shape["heads"] * head_dim * s * s
                        for s in lengths)
    assert counter.get_total_flops() == train_flops(shape, lengths, kept, True) - attention

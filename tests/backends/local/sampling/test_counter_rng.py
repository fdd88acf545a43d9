"""The counter draw u = f(seed, prompt, sample, step): in (0, 1], uniform, the same for a row
whatever else is in the batch, and different when any part of the key changes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from retrain.backends.local.sampling.counter_rng import (  # noqa: E402
    CounterDraws,
    row_keys,
    uniforms,
    uniforms_block,
)


def test_a_rows_draw_depends_only_on_its_key_and_step():
    keys = row_keys([5, 6, 7], [0, 1, 2], 4, torch.device("cpu"))
    alone = row_keys([6], [1], 4, torch.device("cpu"))
    assert torch.equal(keys[4:8], alone)
    for step in (0, 1, 1000, 2**33 + 3):
        assert torch.equal(uniforms(keys, step)[4:8], uniforms(alone, step))
        assert torch.equal(uniforms(keys[[7, 2]], step), uniforms(keys, step)[[7, 2]])
    steps = torch.stack([uniforms(keys, s) for s in range(3)])
    assert len(set(steps.flatten().tolist())) == steps.numel()  # rows and steps all differ


def test_every_part_of_the_key_matters():
    cpu = torch.device("cpu")
    base = uniforms(row_keys([1], [2], 2, cpu), 3)
    for other in (row_keys([9], [2], 2, cpu), row_keys([1], [8], 2, cpu)):
        assert not torch.equal(uniforms(other, 3), base)
    assert base[0] != base[1]


def test_the_draws_are_uniform():
    keys = row_keys(list(range(200)), [0] * 200, 25, torch.device("cpu"))
    u = torch.cat([uniforms(keys, s) for s in range(4)]).sort().values  # 20,000 draws
    assert u.min() > 0 and u.max() <= 1 and u.dtype == torch.float64
    grid = torch.arange(1, u.numel() + 1, dtype=torch.float64) / u.numel()
    ks = float((u - grid).abs().max())
    assert ks < 1.63 / u.numel() ** 0.5  # Kolmogorov-Smirnov at 1%
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005


def test_the_stream_steps_through_the_same_draws():
    draws = CounterDraws([4, 4], [0, 1], 3, torch.device("cpu"))
    keys = row_keys([4, 4], [0, 1], 3, torch.device("cpu"))
    for step in range(3):
        assert torch.equal(draws.step_uniforms(6, torch.device("cpu")), uniforms(keys, step))
    with pytest.raises(ValueError, match="6 rows"):
        draws.step_uniforms(5, torch.device("cpu"))


def test_a_whole_decodes_draws_at_once_are_the_steps_draws_bit_for_bit():
    keys = row_keys([3, 2**40 + 1], [0, 7], 3, torch.device("cpu"))
    block = uniforms_block(keys, 50)
    assert block.shape == (6, 50) and block.dtype == torch.float64
    assert torch.equal(block, torch.stack([uniforms(keys, s) for s in range(50)], dim=1))

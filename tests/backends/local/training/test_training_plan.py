"""Micro-batches planned from the device's free memory (training/plan.py), against stated
fake free-memory figures, and the packed rows they become (training/pack.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from retrain.backends.base import Completion, make_datum  # noqa: E402
from retrain.backends.local.training import plan  # noqa: E402
from retrain.backends.local.training.pack import fill_rows, pack_rows  # noqa: E402

settings.register_profile("retrain", deadline=None, max_examples=200)
settings.load_profile("retrain")

GiB = 2**30
SMOLLM2_VOCAB = 49152


def step(prompts: int = 32, group: int = 8, prompt_len: int = 128, new: int = 256):
    """The issue's step: 32 prompts x 8 completions, 128-token prompts, 256 new tokens."""
    out = []
    for p in range(prompts):
        prompt = [3 + p] * prompt_len
        out += [make_datum(prompt, Completion([5] * new, [-1.0] * new, "length"), 1.0)
                for _ in range(group)]
    return out


def positions(datums, unit) -> int:
    return sum(len(datums[i]) for i in unit.index)


def test_the_cpu_keeps_its_measured_budgets():
    assert plan.cpu_budget() == plan.Budget(plan.AUTO_TOKENS, plan.AUTO_LOGITS)


@pytest.mark.parametrize("free_gib", [75, 130])
def test_an_80gb_card_trains_the_issues_step_in_at_most_four_micro_batches(free_gib):
    """SmolLM2-135M with LoRA saves ~22 KB a layer and token in bf16 (30 layers: 650 KB)."""
    budget = plan.memory_budget(free_gib * GiB, token_bytes=650_000, chunked_head=True)
    assert budget.logits is None and budget.tokens == plan.MAX_TOKENS
    datums = step()
    units = plan.plan(datums, 0, budget, SMOLLM2_VOCAB, packed=True)
    assert 1 <= len(units) <= 4
    sizes = [positions(datums, u) for u in units]
    assert max(sizes) <= budget.tokens and min(sizes) >= 0.9 * max(sizes)  # no straggler
    assert sorted(i for u in units for i in u.index) == list(range(len(datums)))


@given(free=st.integers(0, 200 * GiB), token_bytes=st.integers(1, 4_000_000))
def test_the_budget_leaves_the_stated_headroom(free, token_bytes):
    budget = plan.memory_budget(free, token_bytes, chunked_head=True)
    assert 1 <= budget.tokens <= plan.MAX_TOKENS
    if budget.tokens > 1:  # one position is the floor: an out-of-memory error then halves
        assert budget.tokens * token_bytes * plan.TRANSIENT <= (1 - plan.HEADROOM) * free


def test_less_free_memory_makes_more_and_smaller_micro_batches():
    datums = step(prompts=8)
    counts = []
    for free_gib in (40, 8, 2, 0.5):
        budget = plan.memory_budget(int(free_gib * GiB), 650_000, chunked_head=True)
        units = plan.plan(datums, 0, budget, SMOLLM2_VOCAB, packed=True)
        assert all(positions(datums, u) <= max(budget.tokens, 384) for u in units)
        counts.append(len(units))
    assert counts == sorted(counts) and counts[0] < counts[-1]
    nothing = plan.memory_budget(0, 650_000, chunked_head=True)
    assert [len(u.index) for u in plan.plan(datums, 0, nothing, SMOLLM2_VOCAB, True)] == [1] * 64


def test_micro_batch_size_overrides_the_budget_and_an_unchunked_head_bounds_logits():
    datums = step(prompts=4)
    budget = plan.memory_budget(1 * GiB, 650_000, chunked_head=True)
    assert [len(u.index) for u in plan.plan(datums, 5, budget, SMOLLM2_VOCAB, True)] \
        == [5] * 6 + [2]
    unchunked = plan.memory_budget(1 * GiB, 1, chunked_head=False)
    assert unchunked.logits == int(1 * GiB * (1 - plan.HEADROOM)) // 16
    units = plan.plan(datums, 0, unchunked, SMOLLM2_VOCAB, packed=True)
    kept = [256 * len(u.index) * SMOLLM2_VOCAB for u in units]
    assert max(kept) <= unchunked.logits < 2 * max(kept)


def test_the_probe_counts_saved_activations_once_each_and_leaves_the_rng(model):
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    body = model.base.get_decoder()
    with torch.no_grad():  # as in a forward-only call: the probe still counts training's
        per_token = plan.saved_bytes_per_token(body, model.device)
    assert torch.equal(torch.rand(3), expected)
    assert plan.saved_bytes_per_token(model.base, model.device) >= per_token  # + its head
    cfg = model.base.config  # float32: at least each layer's input, attention and MLP output
    assert per_token >= cfg.num_hidden_layers * (3 * cfg.hidden_size + cfg.intermediate_size) * 4
    assert per_token <= cfg.num_hidden_layers * 64 * (cfg.hidden_size + cfg.intermediate_size)


lengths_st = st.lists(st.integers(1, 60), min_size=1, max_size=30)


@given(lengths_st)
def test_rows_hold_every_sequence_once_within_the_longest(lengths):
    table = dict(enumerate(lengths))
    rows = fill_rows(table, max(lengths))
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(table[i] for i in r) <= max(lengths) for r in rows)
    assert len(rows) <= len(lengths)


@given(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 9)), min_size=1, max_size=8))
def test_packed_positions_restart_per_sequence_and_targets_follow_the_rows(shapes):
    datums = [make_datum([7] * p, Completion(list(range(10, 10 + n)), [-0.5] * n, "stop"),
                         float(k)) for k, (p, n) in enumerate(shapes)]
    unit = plan.Unit(list(range(len(datums))))
    rows = pack_rows(datums, unit, pad_id=0, device=torch.device("cpu"))
    for r, row in enumerate(rows.rows):
        at = 0
        for i in row:
            n = len(datums[i])
            assert rows.positions[r, at:at + n].tolist() == list(range(n))
            assert rows.input_ids[r, at:at + n].tolist() == datums[i].input_tokens
            at += n
        assert rows.positions[r, at:].tolist() == list(range(rows.input_ids.shape[1] - at))
        assert not rows.keep[r, at:].any()
    # the kept positions, row-major, are the targets in order, each its datum's
    kept = rows.input_ids[rows.keep]
    assert rows.t.tokens.tolist() == [datums[i].target_tokens[p] for i, p in rows.t.where]
    assert kept.numel() == rows.t.tokens.numel() == sum(sum(d.mask) for d in datums)
    assert rows.t.advantages.tolist() == [datums[i].advantages[p] for i, p in rows.t.where]
    assert rows.t.sequences == len(datums) and sorted(set(rows.t.seq.tolist())) == list(
        range(len(datums)))

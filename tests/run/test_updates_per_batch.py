"""Several updates per sampled batch: training.mini_batches x training.epochs optimizer steps,
each ratio against the sampler's log-probs (tiny model, a few steps)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from retrain.backends.base import Datum
from retrain.run.update import mini_batches


def _datum(tag: int) -> Datum:
    return Datum([tag], [tag], [0.0], [1.0], [1.0])


@given(st.lists(st.integers(0, 4), max_size=12), st.integers(1, 8))
def test_mini_batches_keep_groups_whole_and_in_order(sizes, n):
    groups = [[_datum(g) for _ in range(k)] for g, k in enumerate(sizes)]
    parts = mini_batches(groups, n)
    nonempty = [g for g in groups if g]
    assert len(parts) == min(n, len(nonempty))
    assert [d for p in parts for d in p] == [d for g in nonempty for d in g]
    for p in parts:  # a group is never split across two mini-batches
        assert p and all(sum(d is e for g in nonempty for e in g) == 1 for d in p)
    tags = [sorted({d.input_tokens[0] for d in p}) for p in parts]
    counts = [len(t) for t in tags]
    assert not counts or max(counts) - min(counts) <= 1
    for a, b in zip(tags, tags[1:], strict=False):
        assert set(a).isdisjoint(b)


# ---------------------------------------------------------------------------- on the tiny model

def _ratio_max(datums, out) -> float:
    return max(math.exp(new - old) for d, lps in zip(datums, out.logprobs, strict=True)
               for old, new, m in zip(d.logprobs, lps, d.mask, strict=True) if m)


def _recorded_run(folder, monkeypatch, **training):
    """Run 3 steps; every forward_backward call's (datums, output), and the rows."""
    pytest.importorskip("torch")
    from retrain.backends.local.backend import LocalBackend
    from retrain.config.loader import load_config
    from retrain.run.single import run_single
    from tests.run_helpers import rows, write_config

    calls = []
    real = LocalBackend.forward_backward

    def recording(self, datums, loss):
        out = real(self, datums, loss)
        calls.append((datums, out))
        return out

    monkeypatch.setattr(LocalBackend, "forward_backward", recording)
    monkeypatch.chdir(folder)
    path = write_config(folder, algorithm={"loss": "ppo"},
                        training={"max_steps": 3, "batch_size": 4, "lr": 5e-2, **training},
                        data={"eval_size": 0})
    assert run_single(load_config(path, {}), path) == 0
    return calls, rows(folder / "logs" / "run")


def test_two_epochs_of_two_mini_batches_make_the_clip_bind(tmp_path, monkeypatch, tiny_model):
    calls, got = _recorded_run(tmp_path, monkeypatch, epochs=2, mini_batches=2)
    assert [r["updates"] for r in got] == [4, 4, 4]
    assert len(calls) == 12
    for step in range(3):
        first, *later = calls[4 * step: 4 * step + 4]
        assert _ratio_max(*first) == pytest.approx(1.0, abs=1e-4)  # on-policy: nothing moved yet
        # the second epoch sees the same datums (each a mini-batch of whole groups)
        assert [id(d) for d in later[1][0]] == [id(d) for d in first[0]]
        # the two mini-batches of an epoch split the step's trained completions between them
        assert len(first[0]) + len(later[0][0]) == got[step]["trained_completions"]
        assert {id(d) for d in first[0]}.isdisjoint(id(d) for d in later[0][0])
    assert any(r["clip_fraction"] > 0 for r in got)
    assert all(r["ratio_max"] >= r["ratio_mean"] > 0 for r in got)
    assert any(r["ratio_max"] > 1.0 + 1e-3 for r in got)


def test_one_by_one_is_one_update_with_ratio_one(tmp_path, monkeypatch, tiny_model):
    calls, got = _recorded_run(tmp_path, monkeypatch)
    assert len(calls) == 3 and [r["updates"] for r in got] == [1, 1, 1]
    for (datums, out), row in zip(calls, got, strict=True):
        assert row["ratio_max"] == pytest.approx(_ratio_max(datums, out), rel=1e-12)
        assert row["ratio_max"] == pytest.approx(1.0, abs=1e-4)
        assert row["clip_fraction"] == 0.0
        # the same weights sampled and trained: no gap beyond float32's rounding
        assert row["sampler_trainer_logprob_diff_p95"] < 1e-4
        assert 0.0 <= row["sampler_trainer_mismatch_kl"] < 1e-8

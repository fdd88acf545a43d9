"""Overlong shaping (DAPO's soft punishment): the penalty by length (pure), and a run whose
completions all hit the limit loses exactly the penalty from its shaped rewards."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from retrain.algorithms.overlong import overlong_penalty


def test_known_values():
    # max_tokens 20, buffer 4: free up to 16, then -1/4 per token, -1 at 20 and beyond
    got = [overlong_penalty(n, 20, 4, 1.0) for n in (0, 16, 17, 18, 20, 25)]
    assert got == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert overlong_penalty(20, 20, 0, 1.0) == 0.0  # buffer 0: off


@given(st.integers(1, 4096), st.integers(0, 4096), st.floats(0, 10), st.integers(0, 5000))
def test_the_penalty_is_monotone_and_bounded(max_tokens, buffer, penalty, n):
    buffer = min(buffer, max_tokens)
    p = overlong_penalty(n, max_tokens, buffer, penalty)
    assert -penalty <= p <= 0.0
    assert overlong_penalty(n + 1, max_tokens, buffer, penalty) <= p
    if n <= max_tokens - buffer:
        assert p == 0.0


def test_a_run_logs_the_mean_penalty(tmp_path, monkeypatch, tiny_model):
    pytest.importorskip("torch")
    from retrain.config.loader import load_config
    from retrain.run.single import run_single
    from tests.run_helpers import rows, write_config

    monkeypatch.chdir(tmp_path)
    path = write_config(tmp_path, reward={"overlong_buffer": 4, "overlong_penalty": 0.5},
                        training={"max_steps": 2, "max_tokens": 8}, data={"eval_size": 0})
    assert run_single(load_config(path, {}), path) == 0
    for r in rows(tmp_path / "logs" / "run"):
        # every completion of the tiny random model runs to max_tokens (no EOS)
        assert r["max_token_hit_rate"] == 1.0
        assert r["overlong_penalty"] == pytest.approx(-0.5)

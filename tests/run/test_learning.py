"""Learning is real: the tiny model learns a simple verifiable reward within 100 steps."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from retrain.config.loader import load_config  # noqa: E402
from retrain.run.single import run_single  # noqa: E402
from tests.run_helpers import rows, write_config  # noqa: E402


def test_tiny_model_learns_to_write_digits(tmp_path, monkeypatch, tiny_model):
    """Reward = fraction of digit characters (a custom reward file next to the config)."""
    monkeypatch.chdir(tmp_path)
    path = write_config(tmp_path, training={"max_steps": 100, "batch_size": 4, "group_size": 8,
                                            "max_tokens": 8, "lr": 1e-2, "save_every": 0},
                        data={"eval_size": 0})
    assert run_single(load_config(path), path) == 0
    got = rows(tmp_path / "logs" / "run")
    assert len(got) == 100
    first = sum(r["mean_reward"] for r in got[:5]) / 5
    last = sum(r["mean_reward"] for r in got[-10:]) / 10
    assert first < 0.3, first
    assert last >= 0.8, (first, last)

"""The learning-rate schedule: the closed form at every step, before and after a SIGKILL and
resume, composed with several updates per step."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from retrain.algorithms.schedule import lr_multiplier, warmup_problem


def closed_form(step: int, max_steps: int, schedule: str, warmup: int, floor: float) -> float:
    """Written out again, independently of retrain.algorithms.schedule: the decay steps
    k = 1..D start at the full rate and reach `floor` one step after the last."""
    if warmup and step <= warmup:
        return step / warmup
    if schedule == "constant":
        return 1.0
    p = min(1.0, (step - warmup - 1) / (max_steps - warmup))
    decay = 1 - p if schedule == "linear" else (1 + math.cos(math.pi * p)) / 2
    return floor + (1 - floor) * decay


def test_known_values():
    assert [lr_multiplier(s, 4, "constant", 2) for s in (1, 2, 3, 4)] == [0.5, 1.0, 1.0, 1.0]
    assert [lr_multiplier(s, 5, "linear", 1, 0.2) for s in range(1, 6)] == \
        pytest.approx([1.0, 1.0, 0.8, 0.6, 0.4])
    assert [lr_multiplier(s, 4, "linear") for s in range(1, 5)] == \
        pytest.approx([1.0, 0.75, 0.5, 0.25])  # the last step trains, at lr / 4
    assert [lr_multiplier(s, 3, "cosine") for s in (1, 2, 3)] == pytest.approx([1.0, 0.75, 0.25])
    assert lr_multiplier(7, 5, "cosine", 0, 0.1) == pytest.approx(0.1)  # past max_steps: floor
    with pytest.raises(ValueError, match="steps count from 1"):
        lr_multiplier(0, 5, "linear")


@given(st.sampled_from(["constant", "linear", "cosine"]), st.integers(1, 200),
       st.integers(0, 50), st.floats(0, 1))
def test_the_schedule_is_its_closed_form_and_stays_in_range(schedule, max_steps, warmup, floor):
    warmup = min(warmup, max_steps - 1)
    values = [lr_multiplier(s, max_steps, schedule, warmup, floor) for s in
              range(1, max_steps + 1)]
    for s, v in enumerate(values, 1):
        assert v == pytest.approx(closed_form(s, max_steps, schedule, warmup, floor), abs=1e-12)
        assert 0 < v <= 1  # no step trains at lr 0
    after = values[warmup:]
    assert after[0] == 1.0  # the first step after the warm-up trains at the full rate
    assert all(a >= b - 1e-12 for a, b in zip(after, after[1:], strict=False))  # never rises
    if schedule != "constant":
        assert lr_multiplier(max_steps + 1, max_steps, schedule, warmup, floor) == \
            pytest.approx(floor)


def test_a_warmup_as_long_as_the_run_is_named():
    assert warmup_problem(10, 9, "linear") == ""
    assert warmup_problem(10, 0, "linear") == ""
    said = warmup_problem(4, 4, "linear")
    assert said.startswith("training.warmup_steps (4) >= training.max_steps (4)")
    assert "only at the last step" in said and "linear decay never starts" in said
    said = warmup_problem(4, 8, "constant")
    assert "last step trains at 0.5 x lr" in said and "decay" not in said


# ---------------------------------------------------------------------------- a real run

COMPARED = ("lr", "loss", "grad_norm", "updates", "clip_fraction", "ratio_max", "mean_reward",
            "sampler_trainer_logprob_diff")


def test_the_lr_is_the_closed_form_across_a_sigkill_and_resume(tmp_path, monkeypatch, cli_env,
                                                               python, tiny_model):
    pytest.importorskip("torch")
    from retrain.config.loader import load_config
    from retrain.run.single import run_single
    from tests.run_helpers import kill_after_step_3_and_resume, rows, same_rows, write_config

    monkeypatch.chdir(tmp_path)
    training = {"max_steps": 6, "batch_size": 2, "group_size": 4, "max_tokens": 8, "lr": 2e-2,
                "lr_schedule": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1,
                "epochs": 2, "mini_batches": 2}
    path = write_config(tmp_path, training=training, algorithm={"loss": "ppo"},
                        data={"eval_size": 0})
    assert run_single(load_config(path, {"logging.log_dir": "straight"}), path) == 0
    straight = rows(tmp_path / "straight" / "run")

    # blocks in step 4's first reward call: 3 steps x 2 prompts x 4 completions before it
    resumed = kill_after_step_3_and_resume(path, cli_env, python, calls=3 * 2 * 4)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    same_rows(straight, resumed, COMPARED)
    for a, b in zip(straight, resumed, strict=True):
        want = 2e-2 * closed_form(a["step"], 6, "cosine", 2, 0.1)
        assert b["lr"] == pytest.approx(want, rel=1e-12)
        assert b["updates"] in (0, 2, 4)  # epochs x the mini-batches that had groups to train
    assert any(r["updates"] == 4 for r in resumed)

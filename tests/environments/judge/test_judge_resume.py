"""Resuming a judged run: the judge's URL, key variable, timeout, retries, concurrency and
failure limit change no math, so a resume may change them; a changed model or rubric is
refused, naming the sub-key (`reward.judge.model`, not `reward.judge`). A key left out and the
same key given at its default are one setting."""

from __future__ import annotations

import re

import pytest

from retrain.config.loader import load_config
from retrain.errors import UserError
from retrain.run import checkpoint
from retrain.run.record import RunRecord
from tests.judge_server import RUBRIC, JudgeServer
from tests.run_helpers import REPO, rows, run_in_process, state, write_config

JUDGE = {"base_url": "http://127.0.0.1:8000/v1", "model": "judge", "rubric": RUBRIC}


def judged_config(folder, max_steps: int = 1, **judge):
    return write_config(folder, "judged", reward={"type": "judge", "judge": JUDGE | judge},
                        data={"source": "arithmetic", "eval_size": 0},
                        training={"max_steps": max_steps, "save_every": 1})


def started(tmp_path):
    """A run folder whose config.toml is the judged config's (as a first launch writes it)."""
    run_dir = tmp_path / "run"
    RunRecord.of(load_config(judged_config(tmp_path))).open(run_dir).close()
    return run_dir


@pytest.mark.parametrize("change", [
    {"base_url": "http://judge.example:9000/v1"}, {"api_key_env": "JUDGE_KEY"},
    {"timeout_s": 5.0}, {"retries": 0}, {"max_concurrent": 16}, {"max_failed_steps": 9},
    {"base_url": "http://judge.example:9000/v1", "timeout_s": 5.0, "retries": 0,
     "max_concurrent": 16},
])
def test_the_judges_transport_may_change_on_a_resume(tmp_path, change):
    run_dir = started(tmp_path)
    checkpoint._check_same_config(run_dir, load_config(judged_config(tmp_path, 2, **change)))


@pytest.mark.parametrize("given", [
    {"mode": "pointwise"}, {"max_tokens": 512, "temperature": 0.0, "rubric_file": ""},
])
def test_a_judge_key_given_at_its_default_is_no_change(tmp_path, given):
    """Started with `mode` left out, resumed with `mode = "pointwise"` (its default): the
    same judge, not `mode: None -> 'pointwise'`."""
    run_dir = started(tmp_path)
    checkpoint._check_same_config(run_dir, load_config(judged_config(tmp_path, 2, **given)))


@pytest.mark.parametrize(("change", "shown"), [
    ({"model": "other"}, "reward.judge.model: 'judge' -> 'other'"),
    ({"mode": "group"}, "reward.judge.mode: 'pointwise' -> 'group'"),
    ({"rubric": "Grade {completion}."}, "reward.judge.rubric: "),
    ({"model": "other", "timeout_s": 5.0}, "reward.judge.model: 'judge' -> 'other')"),
])
def test_a_changed_judge_is_refused_naming_the_sub_key(tmp_path, change, shown):
    run_dir = started(tmp_path)
    with pytest.raises(UserError) as err:
        checkpoint._check_same_config(run_dir, load_config(judged_config(tmp_path, **change)))
    assert shown in str(err.value) and "timeout_s" not in str(err.value)


def test_a_run_resumed_on_another_judge_url_finishes_there(tmp_path, tiny_model):
    first, second = JudgeServer(), JudgeServer()
    try:
        path = judged_config(tmp_path, 1, base_url=first.base_url, retries=1, timeout_s=10.0)
        assert run_in_process([path.name], tmp_path).returncode == 0
        path = judged_config(tmp_path, 2, base_url=second.base_url, retries=0, timeout_s=20.0,
                             max_concurrent=2)
        done = run_in_process([path.name], tmp_path)
    finally:
        first.close()
        second.close()
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = tmp_path / "logs" / "judged"
    assert [r["step"] for r in rows(run_dir)] == [1, 2]
    assert state(run_dir)["status"] == "completed"
    assert first.requests == 8 and second.requests == 8  # batch 2 x group 4 each


def test_the_training_doc_lists_exactly_the_keys_a_resume_may_change():
    """docs/training.md's list is RESUMABLE_CHANGES, no key more or less (a section as
    `[logging]`): the judge's keys were once left out of it."""
    text = (REPO / "docs" / "training.md").read_text()
    bullet = text.split("- Changing a key that alters the training", 1)[1].split("\n- ", 1)[0]
    named = set(re.findall(r"`([^`]+)`", bullet))
    code = {f"[{k[:-1]}]" if k.endswith(".") else k for k in checkpoint.RESUMABLE_CHANGES}
    assert named == code

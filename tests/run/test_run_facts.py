"""What a run fixes when it starts (retrain/run/run_facts.py): its [sft] step count and the
digests of its data. Grown or rewritten data refuses the resume, naming the file and --new; a
finished run re-run does not take more steps because its data grew, and a finished SFT stage's
data is not checked again."""

from __future__ import annotations

import json

import pytest

from retrain.environments.answers import Problem
from retrain.errors import UserError
from retrain.run import checkpoint
from retrain.run.run_facts import RunFacts, check_unchanged, digest
from retrain.runfiles.runlog import RunState


def test_the_digest_sees_content_order_and_rows():
    rows = [Problem("1 + 1?", "2"), Problem("2 + 2?", "4")]
    base = digest("data", "a.jsonl", rows)
    assert base == digest("data", "a.jsonl", [Problem("1 + 1?", "2"), Problem("2 + 2?", "4")])
    assert base.rows == 2 and len(base.sha256) == 64
    assert digest("data", "a.jsonl", rows[::-1]).sha256 != base.sha256
    assert digest("data", "a.jsonl", [rows[0], Problem("2 + 2?", "5")]).sha256 != base.sha256
    assert digest("data", "a.jsonl", rows[:1]).sha256 != base.sha256
    chats = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]]
    assert digest("sft.data", "c.jsonl", chats).sha256 != \
        digest("sft.data", "c.jsonl", [[*chats[0][:1], {"role": "assistant",
                                                        "content": "Hey"}]]).sha256


def test_a_changed_source_is_refused_naming_it_and_new(tmp_path):
    then = digest("sft.data", "chat.jsonl", [["a"], ["b"]])
    state = RunState()
    RunFacts(sft_steps=3, digests=[then]).stamp(state)
    assert state.extra["sft_steps"] == 3
    check_unchanged(tmp_path, state, [then])  # the same data: fine
    check_unchanged(tmp_path, state, [digest("data", "other.jsonl", [1])])  # not read before
    check_unchanged(tmp_path, RunState(), [then])  # a run from before digests: nothing to say
    with pytest.raises(UserError) as grown:
        check_unchanged(tmp_path, state, [digest("sft.data", "chat.jsonl", [["a"], ["b"], ["c"]])])
    said = str(grown.value)
    assert "sft.data = chat.jsonl" in said and "2 rows then, 3 now" in said
    assert "--new" in said and "\n" not in said
    with pytest.raises(UserError, match="the same 2 rows, different content"):
        check_unchanged(tmp_path, state, [digest("sft.data", "chat.jsonl", [["a"], ["B"]])])


def test_the_sft_steps_a_run_started_with_are_kept():
    state = RunState()
    assert checkpoint.fixed_sft_steps(state, 7) == 7  # a run from before: what is asked now
    state.extra["sft_steps"] = 2
    assert checkpoint.fixed_sft_steps(state, 7) == 2
    for odd in (True, -1, "2", 2.0):
        state.extra["sft_steps"] = odd
        assert checkpoint.fixed_sft_steps(state, 7) == 7


# ---------------------------------------------------------------------------- real runs


def _chats(folder, n: int, reply=lambda i: str(2 * i)) -> None:
    lines = [json.dumps({"messages": [{"role": "user", "content": f"{i} + {i}?"},
                                      {"role": "assistant", "content": reply(i)}]})
             for i in range(n)]
    (folder / "chat.jsonl").write_text("\n".join(lines) + "\n")


@pytest.fixture
def sft_run(tmp_path, monkeypatch, tiny_model):
    """An SFT stage of 1 epoch over 8 conversations (2 steps of 4), then 2 RL steps."""
    pytest.importorskip("torch")
    from tests.run_helpers import write_config

    monkeypatch.chdir(tmp_path)
    _chats(tmp_path, 8)
    return write_config(tmp_path, training={"max_steps": 2}, data={"eval_size": 0},
                        sft={"epochs": 1, "lr": 0.02, "batch_size": 4, "max_tokens": 64,
                             "data": {"path": "chat.jsonl"}})


def _launch(path, capsys, **overrides):
    from retrain.config.loader import load_config
    from retrain.run.single import run_single

    capsys.readouterr()
    code = run_single(load_config(path, overrides), path)
    return code, capsys.readouterr().out


def test_grown_data_adds_no_steps_to_a_finished_run(sft_run, tmp_path, capsys):
    """The SFT step count is fixed at the start; once the stage is over its data is not read
    again, so continuing the RL steps is not refused (tests/run/test_sft_run.py: a resume from the
    stage's own resume point is)."""
    from tests.run_helpers import rows, state

    run_dir = tmp_path / "logs" / "run"
    assert _launch(sft_run, capsys)[0] == 0
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3, 4]
    digests = state(run_dir)["extra"]["data_digests"]
    assert set(digests) == {"sft.data", "data"} and digests["sft.data"]["rows"] == 8

    _chats(tmp_path, 12)  # 3 SFT steps at 1 epoch now: the finished run must not move
    code, out = _launch(sft_run, capsys)
    assert code == 0 and "already finished 4 steps; nothing to do" in out
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3, 4]

    code, out = _launch(sft_run, capsys, **{"training.max_steps": 3})
    assert code == 0, out
    got = rows(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5] and got[-1]["phase"] == "rl"
    assert state(run_dir)["extra"]["sft_steps"] == 2
    assert state(run_dir)["extra"]["data_digests"]["sft.data"]["rows"] == 8  # as it was read


def test_rewritten_replies_refuse_the_resume(sft_run, tmp_path, capsys):
    """Same row count, other content (every reply rewritten): refused all the same, from the
    SFT stage's resume point (an SFT run, training.max_steps = 0, continued)."""
    from retrain.config.loader import load_config
    from retrain.run.single import run_single

    assert _launch(sft_run, capsys, **{"training.max_steps": 0})[0] == 0
    _chats(tmp_path, 8, reply=lambda i: f"{2 * i}!")
    with pytest.raises(UserError, match="the same 8 rows, different content"):
        run_single(load_config(sft_run, {"training.max_steps": 2}), sft_run)

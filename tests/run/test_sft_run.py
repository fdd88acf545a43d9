"""The SFT stage in real runs of the tiny model: its loss falls, the RL steps follow in the same
run, a plain SFT run (training.max_steps = 0) continued by raising max_steps repeats the
straight run, a SIGKILL during SFT resumes exactly, `explain` shows the stage, and bad input
is one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

pytest.importorskip("torch")

from retrain.config.loader import load_config  # noqa: E402
from retrain.errors import UserError  # noqa: E402
from retrain.results import model_card  # noqa: E402
from retrain.run.single import run_single  # noqa: E402
from tests import warm  # noqa: E402
from tests.run_helpers import (  # noqa: E402
    newest_resume_point,
    rows,
    run_in_process,
    same_rows,
    state,
    wait_for,
    write_config,
)

SFT_STEPS, RL_STEPS = 6, 2
RL_COMPARED = ("batch_size", "num_completions", "mean_reward", "loss", "grad_norm",
               "mean_completion_tokens", "sampler_trainer_logprob_diff")
SFT_COMPARED = ("sft_loss", "grad_norm", "sft_tokens", "sft_sequences", "sft_epoch")


def write_chats(folder, n=8) -> None:
    """Chat rows with a system prompt, one of them two turns long."""
    lines = []
    for i in range(n):
        msgs = [{"role": "system", "content": "Answer with digits."},
                {"role": "user", "content": f"{i} + {i}?"},
                {"role": "assistant", "content": str(2 * i)}]
        if i == 0:
            msgs += [{"role": "user", "content": "and 3 + 4?"},
                     {"role": "assistant", "content": "7"}]
        lines.append(json.dumps({"messages": msgs}))
    (folder / "chat.jsonl").write_text("\n".join(lines) + "\n")


def sft_config(folder, *, backend: dict | None = None, **sft):
    write_chats(folder)
    table = {"steps": SFT_STEPS, "lr": 0.02, "batch_size": 4, "max_tokens": 64,
             "data": {"path": "chat.jsonl"}} | sft
    return write_config(folder, training={"max_steps": RL_STEPS}, data={"eval_size": 0},
                        sft=table, **({"backend": backend} if backend else {}))


def same_phased_rows(a: list[dict], b: list[dict]) -> None:
    """`b`'s rows are `a`'s, step by step and phase by phase, each phase on its own figures."""
    assert [(r["step"], r["phase"]) for r in b] == [(r["step"], r["phase"]) for r in a]
    for sft, keys in ((True, SFT_COMPARED), (False, RL_COMPARED)):
        same_rows([r for r in a if (r["phase"] == "sft") == sft],
                  [r for r in b if (r["phase"] == "sft") == sft], keys)


def check_sft_then_rl(run_rows: list[dict]) -> None:
    """SFT steps 1..6 with a falling loss, then the RL steps 7..8 with their own columns."""
    assert [r["step"] for r in run_rows] == list(range(1, SFT_STEPS + RL_STEPS + 1))
    sft, rl = run_rows[:SFT_STEPS], run_rows[SFT_STEPS:]
    assert {r["phase"] for r in sft} == {"sft"} and {r["phase"] for r in rl} == {"rl"}
    losses = [r["sft_loss"] for r in sft]
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(r["sft_tokens"] > 0 and "mean_reward" not in r for r in sft)
    assert all("sft_loss" not in r and r["num_completions"] == 8 for r in rl)


def test_sft_then_rl_and_a_plain_sft_run_continued(tmp_path, monkeypatch, tiny_model, capsys):
    """The straight run; then the same as a plain SFT run (max_steps 0), finished, and
    continued by raising max_steps: the RL steps start on the SFT weights as they did."""
    monkeypatch.chdir(tmp_path)
    path = sft_config(tmp_path)
    assert run_single(load_config(path, {"logging.log_dir": "straight"}), path) == 0
    straight = rows(tmp_path / "straight" / "run")
    check_sft_then_rl(straight)
    end = state(tmp_path / "straight" / "run")
    assert end["max_steps"] == SFT_STEPS + RL_STEPS and end["extra"]["sft_steps"] == SFT_STEPS
    assert "phase" not in end["extra"]  # an RL step's resume point

    sft_only = {"logging.log_dir": "split", "training.max_steps": 0}
    assert run_single(load_config(path, sft_only), path) == 0
    run_dir = tmp_path / "split" / "run"
    assert [r["phase"] for r in rows(run_dir)] == ["sft"] * SFT_STEPS
    assert state(run_dir)["status"] == "completed" and state(run_dir)["step"] == SFT_STEPS
    card = model_card.card(run_dir, step=SFT_STEPS, base="tiny-random", merged=False,
                           max_steps=0)
    assert "checkpoint of step 6 of 6." in card and "- `sft_loss`: " in card
    capsys.readouterr()
    assert run_single(load_config(path, sft_only), path) == 0
    assert "already finished 6 steps" in capsys.readouterr().out
    assert run_single(load_config(path, {"logging.log_dir": "split"}), path) == 0
    same_phased_rows(straight, rows(run_dir))
    assert state(run_dir)["status"] == "completed"


def test_kill_during_sft_resumes_exactly(tmp_path, monkeypatch, cli_env, python, tiny_model):
    """SIGKILL while the SFT steps run (frozen first, to read where), resume: the SFT rows
    after the resume point and the RL rows repeat the straight run. The first RL reward call
    blocks, so the process is still in its SFT steps however late the freeze comes; the
    resume point expected is the newest on disk when frozen (a checkpoint's resume point is
    written before state.json moves to it)."""
    monkeypatch.chdir(tmp_path)
    path = sft_config(tmp_path, batch_size=2)
    assert run_single(load_config(path, {"logging.log_dir": "straight"}), path) == 0
    straight = rows(tmp_path / "straight" / "run")

    cmd = [python, "-m", "retrain", "run", str(path), "--log-dir", "killed"]
    env = dict(cli_env, RETRAIN_TEST_COUNTER=str(tmp_path / "calls"),
               RETRAIN_TEST_BLOCK_AFTER="0")  # the first RL step's first reward call blocks
    proc = warm.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                      text=True)
    run_dir = tmp_path / "killed" / "run"
    try:
        wait_for(lambda: (run_dir / "state.json").exists() and state(run_dir)["step"] >= 2,
                 proc, timeout=300)
        os.kill(proc.pid, signal.SIGSTOP)  # freeze, then read where it stands
        killed_at = newest_resume_point(run_dir)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed_at["extra"]["phase"] == "sft" and killed_at["status"] == "running"
    assert 2 <= killed_at["step"] <= SFT_STEPS, killed_at["step"]

    done = run_in_process(cmd[3:], tmp_path)  # the resume: in this process
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"after step {killed_at['step']} (SFT)" in done.stdout
    same_phased_rows(straight, rows(run_dir))
    assert state(run_dir)["status"] == "completed"


def test_explain_shows_the_stage_and_bad_input_is_one_line(tmp_path, cli_env, python):
    path = sft_config(tmp_path)
    retrain = [python, "-m", "retrain"]
    shown = warm.run([*retrain, "explain", str(path)], env=cli_env, capture_output=True,
                     text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "chat.jsonl (jsonl, 8 conversations): 6 steps x 4 conversations" in shown.stdout
    assert "2 RL steps after them" in shown.stdout
    for change, fragment in [("sft.data.path=missing.jsonl", "sft.data.path: "),
                             ("sft.epochs=2", "give sft.steps (6) or sft.epochs (2), not both")]:
        bad = warm.run([*retrain, "run", str(path), "--set", change], env=cli_env,
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert bad.returncode == 2 and fragment in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    (tmp_path / "chat.jsonl").write_text(json.dumps(
        {"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    bad = warm.run([*retrain, "run", str(path)], env=cli_env, capture_output=True,
                   text=True, timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and "chat.jsonl:1" in bad.stderr and "assistant turn" in \
        bad.stderr
    assert not (tmp_path / "logs" / "run" / "metrics.jsonl").exists()


def test_each_conversation_is_tokenized_once(tmp_path, monkeypatch, tiny_model):
    """2 epochs over 8 conversations in 4 steps of 4: each row rendered once, not per step."""
    from retrain.environments.sft import datums as sft_datums
    from retrain.run import sft

    monkeypatch.chdir(tmp_path)
    seen: list[str] = []

    def spied(renderer, messages, *args):
        seen.append(messages[-1]["content"])
        return sft_datums.sft_example(renderer, messages, *args)

    monkeypatch.setattr(sft, "sft_example", spied)
    write_chats(tmp_path)
    path = write_config(tmp_path, training={"max_steps": 0}, data={"eval_size": 0},
                        sft={"epochs": 2, "lr": 0.02, "batch_size": 4, "max_tokens": 64,
                             "data": {"path": "chat.jsonl"}})
    assert run_single(load_config(path), path) == 0
    assert [r["phase"] for r in rows(tmp_path / "logs" / "run")] == ["sft"] * 4
    assert sorted(seen) == sorted(["7", *(str(2 * i) for i in range(1, 8))])  # once each


def test_a_stage_in_which_nothing_trains_is_refused(tmp_path, cli_env, python):
    """Every prompt longer than sft.max_tokens: one line before anything is written, not a
    'completed' run that trained 0 tokens."""
    path = sft_config(tmp_path, max_tokens=16)
    long = [{"messages": [{"role": "user", "content": f"{i} plus {i} " * 20 + "?"},
                          {"role": "assistant", "content": str(2 * i)}]} for i in range(4)]
    (tmp_path / "chat.jsonl").write_text("\n".join(map(json.dumps, long)) + "\n")
    done = run_in_process(["run", str(path)], tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    line = done.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert "no conversation of" in line and "sft.max_tokens = 16" in line
    assert not (tmp_path / "logs" / "run" / "metrics.jsonl").exists()


def test_an_sft_run_is_not_refused_for_a_key_only_rl_steps_use(tmp_path, monkeypatch,
                                                               tiny_model):
    """training.max_tokens past the tiny model's 1024-token context: an RL run is refused at
    start, an SFT run (training.max_steps = 0) samples nothing and runs."""
    monkeypatch.chdir(tmp_path)
    path = sft_config(tmp_path, steps=2)
    too_long = {"training.max_steps": 0, "training.max_tokens": 4096}
    assert run_single(load_config(path, too_long), path) == 0
    assert [r["phase"] for r in rows(tmp_path / "logs" / "run")] == ["sft"] * 2
    with pytest.raises(UserError, match="training.max_tokens = 4096: model 'tiny-random'"):
        run_single(load_config(path, {"training.max_tokens": 4096,
                                      "logging.run_name": "rl"}), path)


def test_a_finished_stage_no_longer_needs_its_file(tmp_path, monkeypatch, tiny_model):
    """Once an RL step has run, [sft.data] may be gone: the resume neither reads nor checks
    it. A resume from an SFT step's resume point still reads it, and checks it."""
    monkeypatch.chdir(tmp_path)
    path = sft_config(tmp_path, steps=2)
    chat = tmp_path / "chat.jsonl"
    run_dir = tmp_path / "logs" / "run"

    def launch(max_steps: int):
        return run_in_process(["run", str(path), "--max-steps", str(max_steps)], tmp_path)

    assert launch(0).returncode == 0  # the SFT steps only: its newest point is the stage's
    kept = chat.read_bytes()
    chat.unlink()
    gone = launch(1)
    assert gone.returncode == 2 and "sft.data.path" in gone.stderr and str(chat) in gone.stderr
    write_chats(tmp_path, n=9)
    grown = launch(1)
    assert grown.returncode == 2 and "8 rows then, 9 now" in grown.stderr
    assert [r["step"] for r in rows(run_dir)] == [1, 2]  # nothing was written

    chat.write_bytes(kept)
    assert launch(1).returncode == 0  # the first RL step: the stage is over
    chat.unlink()
    done = launch(RL_STEPS)
    assert done.returncode == 0, done.stdout + done.stderr
    got = rows(run_dir)
    assert [(r["step"], r["phase"]) for r in got] == [(1, "sft"), (2, "sft"), (3, "rl"),
                                                      (4, "rl")]
    assert state(run_dir)["extra"]["data_digests"]["sft.data"]["rows"] == 8  # kept as it was

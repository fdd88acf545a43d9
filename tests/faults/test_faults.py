"""Fault injection: every damaged file, hostile input and environment fault gets a clear
answer (a finished run, or one `error:` line and the right exit status) and nothing that was
written is lost. The real CLI (`retrain.cli.app.run_app`, in process for speed; a subprocess
where a pipe matters) trains the tiny model for a few steps.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("torch")

from retrain.cli.app import run_app  # noqa: E402
from retrain.runfiles import runlog  # noqa: E402
from tests import warm  # noqa: E402
from tests.run_helpers import rows, state, write_config  # noqa: E402

STEPS = {"max_steps": 4, "save_every": 2, "batch_size": 2, "group_size": 4, "max_tokens": 6}
DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT = "1" + "0" * 400


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = run_app(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_clear_error(err: str, *words: str) -> None:
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    for w in words:
        assert w in err, err


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model) -> Path:
    """A finished 4-step run (checkpoints at steps 2 and 4), trained once for the module."""
    folder = tmp_path_factory.mktemp("trained")
    write_config(folder, training=STEPS, data={"eval_size": 0})
    old = os.getcwd()
    os.chdir(folder)
    try:
        assert run_app(["run.toml"]) == 0
    finally:
        os.chdir(old)
    return folder


@pytest.fixture
def run_copy(trained, tmp_path, monkeypatch) -> Path:
    """A private copy of the trained folder, as the working folder; returns logs/run."""
    shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    saved = tmp_path / "logs" / "run" / "config.toml"  # it names the reward file absolutely
    saved.write_text(saved.read_text().replace(str(trained), str(tmp_path)))
    return tmp_path / "logs" / "run"


def _edit_state(run_dir: Path, **changes) -> None:
    d = state(run_dir)
    for k, v in changes.items():
        if v is KeyError:
            d.pop(k, None)
        else:
            d[k] = v
    (run_dir / "state.json").write_text(json.dumps(d))


def _drop_cursor_field(run_dir: Path) -> None:
    d = state(run_dir)
    del d["data_cursor"]["position"]
    (run_dir / "state.json").write_text(json.dumps(d))


# Each damages state.json of the finished 4-step run; raising max_steps to 6 must resume
# after step 4 (from the resume point checkpoint 4 carries), never start over.
STATE_DAMAGE = {
    "missing": lambda d: (d / "state.json").unlink(),
    "empty": lambda d: (d / "state.json").write_bytes(b""),
    "torn": lambda d: (d / "state.json").write_bytes((d / "state.json").read_bytes()[:40]),
    "binary garbage": lambda d: (d / "state.json").write_bytes(b"\x00\xff\xfe garbage"),
    "not an object": lambda d: (d / "state.json").write_text("[1, 2, 3]"),
    "negative step": lambda d: _edit_state(d, step=-3),
    "string step": lambda d: _edit_state(d, step="4"),
    "step beyond the checkpoints": lambda d: _edit_state(d, step=999),
    "no checkpoint named": lambda d: _edit_state(d, checkpoint=KeyError),
    "cursor field missing": _drop_cursor_field,
    "unknown status": lambda d: _edit_state(d, status=["done"]),
    "deeply nested": lambda d: (d / "state.json").write_text(DEEP),
    "400-digit step": lambda d: (d / "state.json").write_text(f'{{"step": {HUGE_INT}}}'),
}


@pytest.mark.parametrize("damage", list(STATE_DAMAGE))
def test_damaged_state_resumes_from_the_checkpoint(run_copy, capsys, damage):
    before = rows(run_copy)
    STATE_DAMAGE[damage](run_copy)
    code, out, err = cli(capsys, "run.toml", "--max-steps", "6")
    assert code == 0, err
    assert "Traceback" not in err and "resuming" in out and "after step 4" in out, out
    after = rows(run_copy)
    assert [r["step"] for r in after] == [1, 2, 3, 4, 5, 6]
    assert after[:4] == before  # the rows already written are kept byte for byte in value
    assert state(run_copy)["status"] == "completed" and state(run_copy)["step"] == 6


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(run_copy, capsys):
    weights = run_copy / "checkpoints" / "step-000004" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    code, out, err = cli(capsys, "run.toml", "--max-steps", "6")
    assert code == 0, err
    assert "after step 2" in out and "did not load" in out, out
    assert [r["step"] for r in rows(run_copy)] == [1, 2, 3, 4, 5, 6]
    assert state(run_copy)["status"] == "completed"


def test_every_checkpoint_damaged_is_a_clear_error_and_nothing_changes(run_copy, capsys):
    for step in (2, 4):
        (run_copy / "checkpoints" / f"step-00000{step}" / "optimizer.pt").write_bytes(b"junk")
    before = snapshot(run_copy)
    code, _, err = cli(capsys, "run.toml", "--max-steps", "6")
    assert code == 2
    assert_one_clear_error(err, "cannot resume from any checkpoint", "--new")
    assert snapshot(run_copy) == before


def test_no_resume_point_refuses_to_start_over_then_new_moves_it_aside(run_copy, capsys):
    (run_copy / "state.json").unlink()
    for point in (run_copy / "checkpoints").glob("*.json"):
        point.unlink()
    before = snapshot(run_copy)
    code, out, err = cli(capsys, "run.toml", "--max-steps", "6")
    assert code == 2 and "step 1/" not in out
    assert_one_clear_error(err, "4 metrics rows", "step-000004", "--new", "nothing was changed")
    assert snapshot(run_copy) == before
    code, out, err = cli(capsys, "run.toml", "--new")
    assert code == 0, err
    moved = next(run_copy.parent.glob("run.prev-*"))
    assert snapshot(moved) == before and "moved the previous run" in out
    assert [r["step"] for r in rows(run_copy)] == [1, 2, 3, 4]


# ---------------------------------------------------------------------------- hostile JSON

HOSTILE_LINES = [DEEP, f'{{"step": {HUGE_INT}}}', f'{{"step": 5, "mean_reward": {HUGE_INT}}}',
                 '{"step": 6, "note": "\\ud800"}', '{"step": 7, "step_time_s": 1e999}',
                 '{"step": 8, "bp_sigma": -1, "bp_kappa": 0, "bp_lambda": 1, "bp_p": 2, '
                 '"tokens_per_second": 5}', '{"step": true}', '{"step": 9, "los']


def test_hostile_metrics_lines_are_counted_not_fatal(run_copy, capsys):
    pytest.importorskip("matplotlib")
    with open(run_copy / "metrics.jsonl", "a") as fh:
        fh.write("\n".join(HOSTILE_LINES))
    read = runlog.read_metrics(run_copy / "metrics.jsonl")
    assert [r["step"] for r in read.rows][:4] == [1, 2, 3, 4] and read.bad_lines == 5
    code, out, err = cli(capsys, "status", "logs")
    assert code == 0 and "Traceback" not in err and "run" in out
    code, out, err = cli(capsys, "status", "logs", "--json")
    assert code == 0 and json.loads(out)["runs"][0]["bad_lines"] == 5
    code, out, err = cli(capsys, "plot", "logs/run")
    assert code == 0 and (run_copy / "usl.png").is_file(), err
    # resume reads them too: the hostile rows after step 4 are dropped, 1-4 kept
    code, out, err = cli(capsys, "run.toml", "--max-steps", "5")
    assert code == 0, err
    assert [r["step"] for r in rows(run_copy)] == [1, 2, 3, 4, 5]


def test_torn_manifest_still_lists_the_campaign_runs(tmp_path, capsys):
    camp = tmp_path / "logs" / "camp"
    for name in ("a_s1", "b_s1"):
        (camp / name).mkdir(parents=True)
        (camp / name / "metrics.jsonl").write_text('{"step": 1, "step_time_s": 2.0}\n')
    (camp / "manifest.json").write_text('{"campaign": "camp", "runs": [{"name": "a_')
    code, out, err = cli(capsys, "status", str(tmp_path / "logs"))
    assert code == 0, err
    assert "2 runs" in out and "a_s1" in out and "b_s1" in out and "manifest.json" in out
    (camp / "manifest.json").write_text(json.dumps({
        "campaign": ["x"], "status": {"a": 1}, "max_workers": "3", "max_concurrent": -1,
        "slots_dir": "../..", "conditions": [{"a": 1}, "a"], "seeds": [[1], 1],
        "runs": [{"name": ["a_s1"], "log_dir": "../../..", "status": ["running"], "seed": "x",
                  "last_step": "9", "max_steps": -3}, 5, None]}))
    code, out, err = cli(capsys, "status", str(tmp_path / "logs"), "--json")
    assert code == 0 and "Traceback" not in err
    from retrain.campaign.manifest import Manifest

    m = Manifest.from_dict(json.loads((camp / "manifest.json").read_text()))
    assert m.runs[0].seed == 0 and m.runs[0].status == "pending" and m.status == "running"


@pytest.mark.parametrize("line", [DEEP, f'{{"prompt": "2+2?", "answer": {HUGE_INT}}}'])
def test_hostile_data_line_is_a_clear_error(tmp_path, monkeypatch, capsys, line):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n' + line + "\n")
    write_config(tmp_path, data={"source": "jsonl", "path": "data.jsonl", "eval_size": 0})
    code, _, err = cli(capsys, "run.toml")
    assert code == 2
    assert_one_clear_error(err, "data.jsonl:2")


# ---------------------------------------------------------------------------- numbers, sizes

HUGE_REWARD = ("def reward(completion, answer):\n"
               "    return 1e200 if len(completion) % 2 else -1e200\n")


def test_huge_finite_rewards_train_without_overflow(tmp_path, monkeypatch, capsys, tiny_model):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "huge.py").write_text(HUGE_REWARD)
    write_config(tmp_path, training={**STEPS, "max_steps": 2}, data={"eval_size": 0},
                 reward={"function": "huge.py:reward"})
    code, _, err = cli(capsys, "run.toml")
    assert code == 0, err
    for row in rows(tmp_path / "logs" / "run"):
        assert isinstance(row["mean_reward"], float) and isinstance(row["reward_std"], float)
        assert abs(row["mean_reward"]) <= 1e200 and row["reward_std"] <= 1e200


@pytest.mark.parametrize("sets, key", [
    (["training.batch_size=1000000000000"], "training.batch_size"),
    (["training.group_size=100000"], "training.group_size"),
    (["training.batch_size=60000", "training.group_size=4000"], "completions per step"),
    (["training.max_tokens=1000000000"], "training.max_tokens"),
    (["data.size=10000000000"], "data.size"),
])
def test_absurd_sizes_fail_fast_naming_the_key(tmp_path, monkeypatch, capsys, sets, key):
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path)
    args = [a for s in sets for a in ("--set", s)]
    for command in (["run.toml"], ["explain", "run.toml"]):
        code, _, err = cli(capsys, *command, *args)
        assert code == 2
        assert_one_clear_error(err, key)
    assert not (tmp_path / "logs").exists()


def test_max_tokens_past_the_models_context_is_refused_at_start(tmp_path, monkeypatch, capsys,
                                                                tiny_model):
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path, training={"max_tokens": 1024})
    code, _, err = cli(capsys, "run.toml")
    assert code == 2
    assert_one_clear_error(err, "training.max_tokens = 1024", "takes 1024 tokens in all",
                           "below 1024")
    assert not (tmp_path / "logs" / "run" / "metrics.jsonl").exists()


def test_explain_warns_on_huge_steps_and_shows_the_cleaned_campaign_folder(
        tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path, training={"batch_size": 1024, "group_size": 64, "max_tokens": 8192})
    code, out, _ = cli(capsys, "explain", "run.toml")
    assert code == 0 and "tokens (batch_size x group_size x max_tokens)" in out
    write_config(tmp_path, "camp", campaign={"name": "../../escape", "seeds": [1, 2]})
    code, out, _ = cli(capsys, "explain", "camp.toml", "--json")
    folders = {r["folder"] for r in json.loads(out)["runs"]}
    assert len(folders) == 2 and ".." not in str(folders), folders
    assert all(f.startswith(os.path.join("logs", "escape") + os.sep) for f in folders), folders


# ---------------------------------------------------------------------------- environment


def test_log_dir_that_is_a_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path)
    (tmp_path / "afile").write_text("keep me")
    code, _, err = cli(capsys, "run.toml", "--log-dir", "afile")
    assert code == 2
    assert_one_clear_error(err, "logging.log_dir", "afile", "not a folder")
    assert (tmp_path / "afile").read_text() == "keep me"


def _mount_tmpfs(folder: Path, options: str) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                          capture_output=True)
    return done.returncode == 0


def _umount(folder: Path) -> None:
    subprocess.run(["umount", str(folder)], capture_output=True)


def test_read_only_log_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path)
    ro = tmp_path / "ro"
    if not _mount_tmpfs(ro, "ro,size=64k"):
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        code, _, err = cli(capsys, "run.toml", "--log-dir", "ro")
    finally:
        _umount(ro)
    assert code == 2
    assert_one_clear_error(err, "logging.log_dir", "read-only")


def test_full_disk_fails_cleanly_keeps_data_and_resumes(tmp_path, monkeypatch, capsys,
                                                        tiny_model):
    """A 400 KiB tmpfs fills during step ~6 (checkpoints kept every step); without mount
    rights, a simulated ENOSPC in the metrics writer at step 3 stands in for it."""
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path, training={**STEPS, "max_steps": 40, "save_every": 1},
                 data={"eval_size": 0})
    disk = tmp_path / "disk"
    mounted = _mount_tmpfs(disk, "size=400k")
    if not mounted:
        real_write = runlog.MetricsWriter.write

        def write(self, row):
            if row["step"] == 3:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
            real_write(self, row)
        monkeypatch.setattr(runlog.MetricsWriter, "write", write)
    try:
        code, _, err = cli(capsys, "run.toml", "--log-dir", "disk")
        run_dir = disk / "run"
        assert code == 1
        assert_one_clear_error(err, "no space left", "run the same command again")
        saved = state(run_dir)
        assert saved["status"] == "failed" and saved["step"] >= 2
        steps = [r["step"] for r in runlog.read_metrics(run_dir / "metrics.jsonl").rows]
        assert steps[: saved["step"]] == list(range(1, saved["step"] + 1))
        if mounted:
            subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)
        else:
            monkeypatch.undo()
            monkeypatch.chdir(tmp_path)
        done = saved["step"] + 2
        code, out, err = cli(capsys, "run.toml", "--log-dir", "disk", "--max-steps", str(done))
        assert code == 0, err
        assert f"after step {saved['step']}" in out
        assert [r["step"] for r in rows(run_dir)] == list(range(1, done + 1))
    finally:
        if mounted:
            _umount(disk)


def test_lora_target_modules_the_model_lacks(tmp_path, monkeypatch, capsys, tiny_model):
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path, model={"lora_target_modules": ["q_proj", "nope_proj"]})
    code, _, err = cli(capsys, "run.toml")
    assert code == 2
    assert_one_clear_error(err, "model.lora_target_modules", "'nope_proj'", "q_proj")


def test_all_linear_beside_module_names_is_one_clear_error(tmp_path, monkeypatch, capsys,
                                                            tiny_model):
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path, model={"lora_target_modules": ["all-linear", "q_proj"]})
    code, _, err = cli(capsys, "run.toml")
    assert code == 2
    assert_one_clear_error(err, "model.lora_target_modules", "give it alone")


def test_broken_pipe_interrupts_resumably(tmp_path, monkeypatch, capsys, cli_env, python,
                                          tiny_model):
    """`retrain run.toml | head -1`: the run stops after the step in flight, "interrupted"
    (not "failed"), exit 141, and the same command resumes it."""
    write_config(tmp_path, training={**STEPS, "max_steps": 6}, data={"eval_size": 0})
    cmd = [python, "-m", "retrain", "run.toml"]
    proc = warm.Popen(cmd, cwd=tmp_path, env=cli_env, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "broken pipe" in err and "Traceback" not in err
    run_dir = tmp_path / "logs" / "run"
    assert state(run_dir)["status"] == "interrupted"
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(capsys, "run.toml")
    assert code == 0, err
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3, 4, 5, 6]

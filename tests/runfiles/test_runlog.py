"""Run files: metrics.jsonl survives torn lines, JSON state is written atomically."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from retrain.runfiles import runlog
from retrain.runfiles.runlog import MetricsWriter, RunState


def test_writer_appends_one_flushed_row_per_line(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsWriter(path) as w:
        w.write({"step": 1, "loss": 0.5})
        # flushed per row: another reader sees it before close
        assert runlog.read_metrics(path).rows == [{"step": 1, "loss": 0.5}]
        w.write({"step": 2, "loss": float("nan"), "x": [float("inf")]})
    lines = path.read_bytes().splitlines()
    assert len(lines) == 2
    assert json.loads(lines[1]) == {"step": 2, "loss": None, "x": [None]}


def test_reader_skips_and_counts_torn_and_garbage_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\nnot json\n[1, 2]\n\n{"step": 2}\n{"step": 3, "los')
    read = runlog.read_metrics(path)
    assert [r["step"] for r in read.rows] == [1, 2]
    assert read.bad_lines == 3


def test_reader_of_missing_file_is_empty(tmp_path):
    read = runlog.read_metrics(tmp_path / "nope.jsonl")
    assert read.rows == [] and read.bad_lines == 0


def test_writer_after_a_crash_does_not_glue_rows_onto_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2, "lo')
    with MetricsWriter(path) as w:
        w.write({"step": 2})
    read = runlog.read_metrics(path)
    assert [r["step"] for r in read.rows] == [1, 2]
    assert read.bad_lines == 1


def test_truncate_metrics_keeps_rows_through_a_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "x')
    assert runlog.truncate_metrics(path, 2) == 1
    assert [r["step"] for r in runlog.read_metrics(path).rows] == [1, 2]
    assert runlog.read_metrics(path).bad_lines == 0
    assert runlog.truncate_metrics(path, 2) == 0
    assert runlog.truncate_metrics(tmp_path / "missing.jsonl", 1) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_atomic_json_leaves_no_temp_files_and_replaces_whole(tmp_path):
    path = tmp_path / "sub" / "manifest.json"
    runlog.write_json_atomic(path, {"a": 1, "nan": float("nan")})
    runlog.write_json_atomic(path, {"a": 2})
    assert runlog.read_json(path) == {"a": 2}
    assert os.listdir(path.parent) == ["manifest.json"]


def test_read_json_tolerates_garbage(tmp_path):
    bad = tmp_path / "state.json"
    bad.write_text('{"status": "runn')
    assert runlog.read_json(bad) is None
    bad.write_text("[1, 2]")
    assert runlog.read_json(bad) is None
    bad.write_bytes(b"\xff\xfe")
    assert runlog.read_json(bad) is None
    assert runlog.read_json(tmp_path / "missing.json") is None


def test_state_round_trip_and_stamps(tmp_path):
    state = RunState(status="running", step=3, max_steps=10, data_cursor={"epoch": 1})
    runlog.save_state(tmp_path, state)
    back = runlog.load_state(tmp_path)
    assert back == state
    assert back.pid == os.getpid() and back.host and back.updated_at > 0
    # unknown keys from a newer writer are ignored, not fatal
    runlog.write_json_atomic(tmp_path / "state.json", {**state.to_dict(), "future_key": 1})
    assert runlog.load_state(tmp_path).step == 3


def test_pid_alive():
    assert runlog.pid_alive(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not runlog.pid_alive(proc.pid)
    assert not runlog.pid_alive(0)
    assert not runlog.pid_alive(os.getpid(), host="some-other-host")


def test_walk_logs_finds_runs_and_campaigns(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text("")
    (tmp_path / "a" / "checkpoints" / "step1").mkdir(parents=True)
    (tmp_path / "a" / "checkpoints" / "step1" / "state.json").write_text("{}")
    (tmp_path / "camp" / "r1").mkdir(parents=True)
    (tmp_path / "camp" / "manifest.json").write_text("{}")
    (tmp_path / "camp" / "r1" / "state.json").write_text("{}")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "metrics.jsonl").write_text("")
    (tmp_path / "empty").mkdir()
    runs, campaigns = runlog.walk_logs(tmp_path)
    assert runs == [tmp_path / "a", tmp_path / "camp" / "r1"]
    assert campaigns == [tmp_path / "camp"]


def test_hostile_json_is_a_bad_line_not_a_crash(tmp_path):
    """safejson's limits: deep nesting, 400-digit integers and lone surrogates are bad lines;
    non-finite numbers read as null."""
    from retrain.runfiles import safejson

    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(["[" * 100_000 + "]" * 100_000, '{"step": 1' + "0" * 400 + "}",
                               '{"step": 2, "x": "\\ud800"}', '{"step": 3, "a": NaN, "b": 1e999}',
                               '{"step": 4, "deep": ' + "[" * 70 + "]" * 70 + "}"]))
    read = runlog.read_metrics(path)
    assert read.rows == [{"step": 3, "a": None, "b": None}] and read.bad_lines == 4
    (tmp_path / "state.json").write_text('{"step": ' + "9" * 400 + "}")
    assert runlog.read_json(tmp_path / "state.json") is None
    (tmp_path / "empty.json").write_text("")
    with pytest.raises(safejson.BadJSON, match="empty"):
        safejson.read_object(tmp_path / "empty.json")


@pytest.mark.parametrize("change, problem", [
    ({"step": -1}, "step is -1"), ({"step": "3"}, "step is '3'"),
    ({"status": ["x"]}, "status is"), ({"data_cursor": []}, "data_cursor is list"),
    ({"checkpoint": 5}, "checkpoint is 5"), ({"max_steps": True}, "max_steps is True"),
])
def test_state_with_wrong_types_is_reported_not_loaded(tmp_path, change, problem):
    good = RunState(status="running", step=3, checkpoint="x/step-000003",
                    data_cursor={"epoch": 0, "position": 6})
    runlog.write_json_atomic(tmp_path / "state.json", {**good.to_dict(), **change})
    read = runlog.read_state(tmp_path)
    assert read.state is None and problem in read.problem
    assert runlog.load_state(tmp_path) is None


def test_resume_problems_of_a_well_typed_state():
    ok = RunState(step=3, checkpoint="logs/r/checkpoints/step-000003",
                  data_cursor={"epoch": 0, "position": 6})
    assert ok.resume_problem() == "" and RunState().resume_problem() == ""
    assert "no checkpoint" in RunState(step=3, data_cursor=ok.data_cursor).resume_problem()
    assert "position" in RunState(step=3, checkpoint=ok.checkpoint,
                                  data_cursor={"epoch": 0}).resume_problem()
    wrong = RunState(step=9, checkpoint=ok.checkpoint, data_cursor=ok.data_cursor)
    assert "checkpoint is of step 3" in wrong.resume_problem()


def test_failed_state_is_written_in_place_when_the_disk_is_full(tmp_path, monkeypatch):
    import errno

    state = RunState(status="running", step=2, error="")
    runlog.save_state(tmp_path, state)
    size = (tmp_path / "state.json").stat().st_size

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(runlog, "replace_atomically", full)
    state.status, state.error = "failed", "OSError: " + "x" * 5000
    runlog.save_state_even_if_full(tmp_path, state)
    assert (tmp_path / "state.json").stat().st_size == size
    back = runlog.load_state(tmp_path)
    assert back.status == "failed" and back.step == 2 and back.error.startswith("OSError: x")


def test_prune_removes_resume_points_with_their_checkpoints(tmp_path):
    from retrain.run import checkpoint

    folder = tmp_path / "checkpoints"
    for step in range(1, 6):
        (folder / checkpoint.checkpoint_name(step)).mkdir(parents=True)
        (folder / f"{checkpoint.checkpoint_name(step)}.json").write_text("{}")
    (folder / ".step-000006.json.abc.tmp").write_text("torn")
    checkpoint.prune(folder, current=5, save_every=2, max_steps=10)
    assert sorted(p.name for p in folder.iterdir()) == [
        "step-000002", "step-000002.json", "step-000004", "step-000004.json",
        "step-000005", "step-000005.json"]


def _mode(path) -> int:
    return os.stat(path).st_mode & 0o777


def test_atomic_writes_get_the_mode_a_plain_open_gives(tmp_path):
    """0666 less the umask for a new file (not mkstemp's 0600), the old mode for a file
    rewritten."""
    old = os.umask(0o027)
    try:
        runlog.write_json_atomic(tmp_path / "a.json", {"x": 1})
        os.umask(0o022)
        runlog.write_json_atomic(tmp_path / "b.json", {"x": 1})
        os.chmod(tmp_path / "b.json", 0o604)
        runlog.write_json_atomic(tmp_path / "b.json", {"x": 2})
    finally:
        os.umask(old)
    assert _mode(tmp_path / "a.json") == 0o640
    assert _mode(tmp_path / "b.json") == 0o604 and runlog.read_json(tmp_path / "b.json") == {"x": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json"]

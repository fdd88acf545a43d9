"""Run files: metrics.jsonl survives torn lines, JSON state is written atomically."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from retrain import runlog
from retrain.runlog import MetricsWriter, RunState


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

"""The results commands on a tinker run, against `retrain serve` (tiny model, real HTTP): eval
samples the saved tinker:// checkpoint through the SDK and repeats the run's own eval; sample
answers through the SDK; export says how to fetch the checkpoint. The commands run in this
process (run_helpers.run_in_process): what is tested is what they do, not their process."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tinker")
pytest.importorskip("scipy")

from tests.backends.tinker.test_tinker_e2e import rows, write_config  # noqa: E402
from tests.results_helpers import snapshot  # noqa: E402
from tests.run_helpers import run_in_process  # noqa: E402


def test_eval_sample_and_export_of_a_tinker_run(tiny_server, tmp_path, sdk_env):
    def retrain(*args):
        return run_in_process(list(args), tmp_path)

    cfg = write_config(tmp_path, "remote", backend="tinker", url=tiny_server.url, steps=3)
    cfg.write_text(cfg.read_text().replace("eval_size = 0", "eval_size = 8"))
    done = retrain(cfg.name)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "logs" / "remote"
    logged = [r["eval_accuracy"] for r in rows(run) if "eval_accuracy" in r]
    before = snapshot(run)
    requests = tiny_server.traffic.requests

    ev = retrain("eval", "logs/remote", "--json")
    assert ev.returncode == 0, ev.stderr[-3000:]
    report = json.loads(ev.stdout)
    assert report["step"] == 3 and report["accuracy"]["value"] == logged[-1]
    records = (run / "evals" / "heldout-step3.jsonl").read_text().splitlines()
    assert len(records) == 8 and tiny_server.traffic.requests - requests >= 8
    assert {k: v for k, v in snapshot(run).items() if not k.startswith("evals/")} == before

    said = retrain("sample", "logs/remote", "What is 1 + 1?", "--temperature", "0")
    assert said.returncode == 0 and said.stdout.strip(), said.stderr[-3000:]

    exp = retrain("export", "logs/remote", "out")
    assert exp.returncode == 2 and exp.stderr.startswith("error: ")
    assert "tinker checkpoint download tinker://" in exp.stderr and "did not hand out" in exp.stderr
    assert len(exp.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.tmp").exists()

"""`retrain eval` on a run whose environment plays episodes: it plays the run's own held-out
episodes with the checkpoint and repeats the run's eval_accuracy and eval_mean_reward."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("scipy")

from retrain.cli.app import run_app  # noqa: E402
from retrain.config import toml_io  # noqa: E402
from retrain.results.evaluate import EvalRequest, evaluate  # noqa: E402
from tests.environments.test_environment_runs import ENVS, env_config  # noqa: E402
from tests.run_helpers import rows  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model):
    """2 steps of the Fingerprint environment (each reply scored by a checksum of its text,
    never 0), 4 held-out episodes evaluated after step 2, a checkpoint every step."""
    folder = tmp_path_factory.mktemp("episodes-run")
    shutil.copy(ENVS / "counter_env.py", folder / "counter_env.py")
    path = env_config(folder, "Fingerprint", params={"turns": 2},
                      training={"eval_every": 2, "save_every": 1})
    raw = toml_io.loads(path.read_text())
    raw["data"]["eval_size"] = 4
    raw["logging"]["log_dir"] = str(folder / "logs")
    path.write_text(toml_io.dumps(raw))
    assert run_app(["run", str(path)]) == 0
    return folder / "logs" / "run"


def test_eval_plays_the_runs_own_held_out_episodes(run_dir):
    logged = [r for r in rows(run_dir) if "eval_accuracy" in r]
    assert [r["step"] for r in logged] == [2]
    report = evaluate(run_dir, EvalRequest(step=2))
    assert report.unit == "episodes" and report.problems == 4
    assert report.accuracy.value == logged[0]["eval_accuracy"]
    assert report.mean_reward == pytest.approx(logged[0]["eval_mean_reward"], abs=1e-12)
    # every reply scores in (0, 1] by its checksum, so the equality above tells checkpoints
    # apart (with the Digits environment a random model's replies could all score 0)
    assert report.mean_reward > 0
    records = [json.loads(x) for x in Path(report.file).read_text().splitlines()]
    assert len(records) == 4 and {r["turns"] for r in records} == {2}
    assert records[0]["messages"][0]["role"] == "user"
    assert sum(r["reward"] for r in records) / 4 == pytest.approx(report.mean_reward)


def test_sampled_episodes_report_pass_at_k(run_dir, capsys):
    code = run_app(["eval", str(run_dir), "--samples", "2", "--temperature", "1.0", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["unit"], report["problems"], report["samples"]) == ("episodes", 4, 2)
    assert report["reward"].startswith("environment python")
    written = (run_dir / "evals" / "heldout-step2-k2-t1.jsonl").read_text().splitlines()
    assert len(written) == 8 and {json.loads(x)["sample"] for x in written} == {0, 1}


def test_no_held_out_episodes_is_one_clear_line(run_dir, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    config = copy / "config.toml"
    config.write_text(config.read_text().replace("eval_size = 4", "eval_size = 0"))
    assert run_app(["eval", str(copy)]) == 2
    err = capsys.readouterr().err
    assert "no held-out episodes (data.eval_size = 0)" in err and "Traceback" not in err

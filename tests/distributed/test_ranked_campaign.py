"""A campaign of a 2-rank run on the local executor: the run starts its own 2 ranks (the
runner counts them against max_workers: tests/campaign/test_seats.py), and its rows are rank
0's, with world_size 2, and equal a one-process run of the same seed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from bench.campaign.tiny import tiny_campaign_toml
from tests.run_helpers import run_in_process


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]


def test_a_campaign_of_a_two_rank_run_matches_one_process(tmp_path, cli_env, python,
                                                          model_cache, tiny_model):
    path = tmp_path / "exp.toml"
    path.write_text(tiny_campaign_toml(tmp_path / "logs", "[1]", max_steps=2, max_workers=2,
                                       tables="[distributed]\nnproc_per_node = 2\n"))
    done = subprocess.run([python, "-m", "retrain", str(path)], cwd=tmp_path, env=cli_env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    run = tmp_path / "logs" / "exp" / "base_s1"
    manifest = json.loads((tmp_path / "logs" / "exp" / "manifest.json").read_text())
    assert [e["status"] for e in manifest["runs"]] == ["completed"]
    one = tmp_path / "one.toml"  # seed 1 in one process
    one.write_text(tiny_campaign_toml(tmp_path / "one", "[1]", max_steps=2, max_workers=1))
    assert run_in_process([str(one)], tmp_path, {"RETRAIN_CACHE": str(model_cache)}
                          ).returncode == 0
    ref = tmp_path / "one" / "one" / "base_s1"
    for want, got in zip(_rows(ref), _rows(run), strict=True):
        assert got["world_size"] == 2 and want["world_size"] == 1
        assert [got[k] for k in ("mean_reward", "sampled_tokens", "mean_completion_tokens")] \
            == [want[k] for k in ("mean_reward", "sampled_tokens", "mean_completion_tokens")]

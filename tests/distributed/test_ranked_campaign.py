"""A campaign of a 2-rank run on the local executor: the run starts its own 2 ranks (the
runner counts them against max_workers: tests/campaign/test_seats.py) and completes, its rows
rank 0's with world_size 2 (that a 2-rank run's rows equal one process's: test_ranked_run)."""

from __future__ import annotations

import json
import subprocess

from bench.campaign.tiny import tiny_campaign_toml


def test_a_campaign_of_a_two_rank_run_completes(tmp_path, cli_env, python, tiny_model):
    path = tmp_path / "exp.toml"
    path.write_text(tiny_campaign_toml(tmp_path / "logs", "[1]", max_steps=2, max_workers=2,
                                       tables="[distributed]\nnproc_per_node = 2\n"))
    done = subprocess.run([python, "-m", "retrain", str(path)], cwd=tmp_path, env=cli_env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    manifest = json.loads((tmp_path / "logs" / "exp" / "manifest.json").read_text())
    assert [e["status"] for e in manifest["runs"]] == ["completed"]
    run = tmp_path / "logs" / "exp" / "base_s1"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    assert [r["step"] for r in rows] == [1, 2] and {r["world_size"] for r in rows} == {2}

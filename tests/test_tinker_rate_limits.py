"""Queue, don't fail, on rate limits: a 6-run campaign with backend = "tinker" against a real
`retrain serve --max-sessions 2` process, with `max_concurrent = 4` above the server's limit.
The runs that find the server full are answered 429, wait, and all six complete."""

from __future__ import annotations

import json
import subprocess

import pytest

pytest.importorskip("tinker")
pytest.importorskip("retrain.campaign.runner")

from tests.run_helpers import read_serve_url, rows, write_config  # noqa: E402

KEY = "tml-rate-limit-test"


@pytest.fixture
def serve_url(cli_env, python, tiny_model, tmp_path):
    """`retrain serve` as users start it, holding at most 2 training clients."""
    env = {**cli_env, "RETRAIN_SERVE_DIR": str(tmp_path / "serve-state")}
    proc = subprocess.Popen([python, "-m", "retrain", "serve", "--model", "tiny-random",
                             "--port", "0", "--dtype", "float32", "--max-sessions", "2"],
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        yield read_serve_url(proc, 120)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_six_run_campaign_above_the_session_limit_completes(serve_url, tmp_path, cli_env,
                                                            python):
    path = write_config(
        tmp_path, name="camp",
        model={"name": "tiny-random", "lora_rank": 8},
        data={"eval_size": 0},
        training={"max_steps": 2, "batch_size": 2, "group_size": 4, "max_tokens": 6,
                  "save_every": 0},
        backend={"backend": "tinker", "base_url": serve_url, "max_concurrent": 4,
                 "request_timeout_s": 120.0},
        campaign={"seeds": [1, 2, 3, 4, 5, 6], "parallel": True, "max_workers": 6,
                  "stagger_seconds": 0.0, "max_retries": 0})
    # Each run holds its training client for >= 16 s (16 completions, scored in 1 s each):
    # longer than the SDK's own 429 retries, so the runs beyond the limit must queue in the
    # backend, however unevenly a loaded machine starts the six workers.
    env = {**cli_env, "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0",
           "RETRAIN_TEST_REWARD_DELAY": "1.0"}
    proc = subprocess.run([python, "-m", "retrain", "run", str(path)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    campaign = tmp_path / "logs" / "camp"
    manifest = json.loads((campaign / "manifest.json").read_text())
    assert [r["status"] for r in manifest["runs"]] == ["completed"] * 6
    runs = [p.parent for p in campaign.rglob("metrics.jsonl")]
    assert len(runs) == 6
    waits = [rows(run)[0]["api_wait_s"] for run in runs]
    for run in runs:
        assert [r["step"] for r in rows(run)] == [1, 2]
    # at most two runs found a free place at once: the others waited out 429s, and the
    # time they lost shows in their first step's api_wait_s
    assert sum(w > 1.0 for w in waits) >= 3, waits
    logs = [(run / "worker.log").read_text() for run in runs if (run / "worker.log").exists()]
    queued = [text for text in logs if "rate-limited (HTTP 429)" in text]
    assert len(queued) >= 1, logs  # the backend itself queued (the SDK's retries ran out)

"""Queue, don't fail, on rate limits: a 6-run campaign with backend = "tinker" against a real
`retrain serve --max-sessions 1` process, with `max_concurrent = 4` above the server's limit.
The runs that find the server full are answered 429, wait, and all three complete. And a
backend that is answered 429 waits what the service's Retry-After asks, not more."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest

pytest.importorskip("tinker")
pytest.importorskip("retrain.campaign.runner")

from retrain.backends.tinker.backend import TinkerBackend  # noqa: E402
from retrain.backends.tinker.rate_limit import (  # noqa: E402
    RATE_LIMIT_FIRST_S,
    RETRY_AFTER_JITTER,
    RateLimitWait,
)
from tests import warm  # noqa: E402
from tests.run_helpers import read_serve_url, rows, write_config  # noqa: E402
from tests.serve_doubles import BigramEngine, Served  # noqa: E402

KEY = "tml-rate-limit-test"


@pytest.fixture
def serve_url(cli_env, python, tiny_model, tmp_path):
    """`retrain serve` as users start it, holding at most 1 training client."""
    env = {**cli_env, "RETRAIN_SERVE_DIR": str(tmp_path / "serve-state")}
    proc = warm.Popen([python, "-m", "retrain", "serve", "--model", "tiny-random",
                       "--port", "0", "--dtype", "float32", "--max-sessions", "1"],
                      env=env, stderr=subprocess.PIPE, text=True)
    try:
        yield read_serve_url(proc, 120)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_campaign_above_the_session_limit_completes(serve_url, tmp_path, cli_env, python):
    path = write_config(
        tmp_path, name="camp",
        model={"name": "tiny-random", "lora_rank": 8},
        data={"eval_size": 0},
        training={"max_steps": 2, "batch_size": 2, "group_size": 4, "max_tokens": 6,
                  "save_every": 0},
        backend={"backend": "tinker", "base_url": serve_url, "max_concurrent": 4,
                 "request_timeout_s": 120.0},
        campaign={"seeds": [1, 2, 3], "parallel": True, "max_workers": 3,
                  "stagger_seconds": 0.0, "max_retries": 0})
    # Each run holds the server's one training client for >= 8 s (16 completions, scored in
    # 0.5 s each), so the workers that reach the server while a run holds it are refused and
    # queue: three waves of one run, where six runs over two places took as many waves.
    env = {**cli_env, "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0",
           "RETRAIN_TEST_REWARD_DELAY": "0.5"}
    proc = warm.run([python, "-m", "retrain", "run", str(path)], env=env, cwd=tmp_path,
                    capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    campaign = tmp_path / "logs" / "camp"
    manifest = json.loads((campaign / "manifest.json").read_text())
    assert [r["status"] for r in manifest["runs"]] == ["completed"] * 3
    runs = [p.parent for p in campaign.rglob("metrics.jsonl")]
    assert len(runs) == 3
    for run in runs:
        assert [r["step"] for r in rows(run)] == [1, 2]
    # The runs the server refused are those whose worker warned of a 429. How many there
    # are depends on when each worker reached the server: on a loaded machine the runs start
    # tens of seconds apart, and a late worker finds a place that an early run freed (in one
    # campaign of six runs over two places only 2 waited). What does not depend on it: the
    # backoff of each refused run is counted in its first step's api_wait_s (the first
    # backoff alone is at least RATE_LIMIT_FIRST_S / 2; a run that got its place at once
    # waits ~ms).
    logs = {run: (run / "worker.log").read_text() for run in runs}
    queued = [run for run in runs if "rate-limited (HTTP 429)" in logs[run]]
    assert len(queued) >= 1, logs  # the backend itself queued (the SDK does not retry 429s)
    waits = {run.name: rows(run)[0]["api_wait_s"] for run in queued}
    assert all(w >= RATE_LIMIT_FIRST_S / 2 for w in waits.values()), waits


def test_backoff_waits_what_retry_after_asks(tmp_path, sdk_env):
    """serve holds one training client (max_sessions = 1) and answers more with 429 and
    `retry-after: 1`: a second backend asks again every 1 to 1.25 s (its own backoff would
    grow 0.5, 1, 2, 4 s), and has its client within that of the place being freed."""
    def backend(url):
        return TinkerBackend(base_model="bigram-test", lora_rank=2, seed=0, base_url=url,
                             request_timeout_s=30)

    with Served(BigramEngine(), tmp_path, hold_s=2.0, max_sessions=1) as served:
        first = backend(served.url)
        assert first.training.model_id
        asked: list[float] = []   # when the server received each create_model
        create = served.service.create_model

        def timed(req):
            asked.append(time.monotonic())
            return create(req)

        served.service.create_model = timed
        second = backend(served.url)
        waiter = threading.Thread(target=lambda: second.training, daemon=True)
        waiter.start()
        time.sleep(5.5)
        refused = len(asked)
        freed = time.monotonic()
        first.close()
        waiter.join(30)
        assert second._training is not None
        second.close()
    gaps = [b - a for a, b in zip(asked, asked[1:], strict=False)]
    assert refused >= 4, asked                      # 5.5 s of 1 s waits
    assert all(0.95 <= g <= RETRY_AFTER_JITTER + 0.5 for g in gaps), gaps
    assert asked[-1] - freed <= RETRY_AFTER_JITTER + 0.5


def test_retry_after_is_bounded():
    wait = RateLimitWait("x")
    assert 15.0 <= wait.delay(1e9) <= 15.0 * RETRY_AFTER_JITTER    # at most the cap
    assert 0.1 <= wait.delay(0.0) <= 0.1 * RETRY_AFTER_JITTER      # "now" is not a hot loop
    assert RATE_LIMIT_FIRST_S / 2 <= wait.delay(None) <= RATE_LIMIT_FIRST_S  # no header

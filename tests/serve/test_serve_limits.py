"""`retrain serve` knobs for tests and benchmarks, against the unmodified tinker SDK:
added latency per request (`--delay-ms`) and a cap on concurrent training clients
(`--max-sessions`, HTTP 429 beyond it, a place freed when a session finishes or stops
heart-beating)."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")
from tinker import types  # noqa: E402

from tests import warm  # noqa: E402
from tests.run_helpers import read_serve_url  # noqa: E402
from tests.serve_doubles import KEY, BigramEngine, Served  # noqa: E402

H = {"X-API-Key": KEY}


def _timed_get(url: str) -> float:
    t0 = time.monotonic()
    assert httpx.get(f"{url}/api/v1/healthz", headers=H).status_code == 200
    return time.monotonic() - t0


def _raw_training_client(url: str) -> httpx.Response:
    """A session and a model created over plain HTTP: no SDK, so no heartbeats."""
    sess = httpx.post(f"{url}/api/v1/create_session", headers=H,
                      json={"tags": [], "user_metadata": {}, "sdk_version": "x"}).json()
    return httpx.post(f"{url}/api/v1/create_model", headers=H, json={
        "session_id": sess["session_id"], "model_seq_id": 0, "base_model": "bigram-test",
        "lora_config": {"rank": 2}})


def test_delay_is_added_to_every_request(tmp_path, sdk_env):
    with Served(BigramEngine(), tmp_path, hold_s=2.0) as plain:
        base = min(_timed_get(plain.url) for _ in range(3))
    with Served(BigramEngine(), tmp_path, hold_s=2.0, delay_s=0.3) as slow:
        delayed = min(_timed_get(slow.url) for _ in range(3))
        service = tinker.ServiceClient(base_url=slow.url)
        sc = service.create_sampling_client(base_model="bigram-test").result()
        t0 = time.monotonic()
        res = sc.sample(types.ModelInput.from_ints([1]), 2,
                        types.SamplingParams(max_tokens=2)).result()
        sample_s = time.monotonic() - t0
        service.close("success").result()
    assert base < 0.25 and delayed >= 0.3
    assert len(res.sequences) == 2 and sample_s >= 0.6  # asample + retrieve_future


def test_max_sessions_answers_429_until_a_session_finishes(tmp_path, sdk_env):
    with Served(BigramEngine(), tmp_path, hold_s=2.0, max_sessions=1) as served:
        first = tinker.ServiceClient(base_url=served.url)
        first.create_lora_training_client(base_model="bigram-test", rank=2).result()
        refused = _raw_training_client(served.url)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert "limit of 1 concurrent training clients (--max-sessions)" in \
            refused.json()["error"]
        got = {}

        def second():  # the SDK backs off on 429 and retries by itself
            service = tinker.ServiceClient(base_url=served.url)
            got["tc"] = service.create_lora_training_client(
                base_model="bigram-test", rank=2).result()
            got["service"] = service

        waiter = threading.Thread(target=second, daemon=True)
        waiter.start()
        time.sleep(2.0)
        assert waiter.is_alive() and served.service.live_sessions() == 1  # still waiting
        first.close("success").result()
        waiter.join(30)
        assert "tc" in got and served.service.live_sessions() == 1
        got["service"].close("success").result()


def test_a_session_without_heartbeats_frees_its_place(tmp_path, sdk_env):
    with Served(BigramEngine(), tmp_path, hold_s=2.0, max_sessions=1, reap_every_s=0.2,
                session_timeout_s=3.0) as served:
        assert _raw_training_client(served.url).status_code == 200   # then goes silent
        assert _raw_training_client(served.url).status_code == 429
        t0 = time.monotonic()
        service = tinker.ServiceClient(base_url=served.url)
        tc = service.create_lora_training_client(base_model="bigram-test", rank=2).result()
        assert tc.model_id and time.monotonic() - t0 < 20
        service.close("success").result()


def test_retrain_serve_options(cli_env, python, tiny_model, tmp_path, sdk_env):
    """`retrain serve --delay-ms 200 --max-sessions 1` as users start it."""
    env = {**cli_env, "RETRAIN_SERVE_DIR": str(tmp_path / "state"),
           "RETRAIN_SERVE_API_KEY": KEY}
    proc = warm.Popen([python, "-m", "retrain", "serve", "--model", "tiny-random",
                       "--port", "0", "--dtype", "float32", "--delay-ms", "200",
                       "--max-sessions", "1"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = read_serve_url(proc, 60)
        assert _timed_get(url) >= 0.2
        service = tinker.ServiceClient(base_url=url)
        service.create_lora_training_client(base_model="tiny-random", rank=2).result()
        sess = httpx.post(f"{url}/api/v1/create_session", headers=H,
                          json={"tags": [], "user_metadata": {}, "sdk_version": "x"}).json()
        r = httpx.post(f"{url}/api/v1/create_model", headers=H, json={
            "session_id": sess["session_id"], "model_seq_id": 0, "base_model": "tiny-random"})
        assert r.status_code == 429 and "--max-sessions" in r.json()["error"]
        service.close("success").result()
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[1]
    assert proc.returncode in (0, -15) and "Traceback" not in out, out[-2000:]


CLIENT = """
import sys, time, tinker
service = tinker.ServiceClient(base_url=sys.argv[1])
tc = service.create_lora_training_client(base_model="bigram-test", rank=2).result()
print(tc.model_id, flush=True)
time.sleep(600)
"""


def test_a_killed_sdk_client_frees_its_place_within_30s(tmp_path, sdk_env, python):
    """A real SDK client process, SIGKILLed: its heartbeats stop, and with the server's
    default timings its place (--max-sessions) and its adapter are freed within 30 s."""
    with Served(BigramEngine(), tmp_path, hold_s=2.0, max_sessions=1) as served:
        client = subprocess.Popen([python, "-c", CLIENT, served.url], stdout=subprocess.PIPE,
                                  text=True)
        try:
            model_id = client.stdout.readline().strip()
            assert model_id in served.engine.adapters
            time.sleep(11)  # at least one heartbeat went through: the session was alive
            assert _raw_training_client(served.url).status_code == 429
        finally:
            client.kill()
            client.wait(10)
        killed = time.monotonic()
        service = tinker.ServiceClient(base_url=served.url)
        while True:  # the SDK retries 429s for a while by itself, then raises
            try:
                tc = service.create_lora_training_client(base_model="bigram-test",
                                                         rank=2).result()
                break
            except tinker.RateLimitError:
                assert time.monotonic() - killed < 60
        waited = time.monotonic() - killed
        assert waited < 30, waited
        assert model_id not in served.engine.adapters and tc.model_id in served.engine.adapters
        service.close("success").result()

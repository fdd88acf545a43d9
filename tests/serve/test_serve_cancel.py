"""The work of a client that is gone stops: a tinker SDK client killed (SIGKILL) while
`retrain serve` decodes its 2048 completions no longer holds the model for the minutes that
decode takes. It is cancelled between two decoding steps once nobody polls its future, or
once its session times out, and the next client's 4-token request is answered in seconds.
A live client's slow request, polled all along, is never cancelled."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from retrain.backends.base import SamplingParams  # noqa: E402
from tests.serve_doubles import BigramEngine, Served  # noqa: E402

GONE_CLIENT = textwrap.dedent("""
    import sys
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=sys.argv[1])
    sc = service.create_sampling_client(base_model="tiny-random")
    sc.sample(types.ModelInput.from_ints([5, 6, 7]), 2048,
              types.SamplingParams(max_tokens=256, seed=1)).result()
""")


@pytest.mark.parametrize("noticed_by", ["unpolled", "session_timeout"])
def test_a_killed_clients_sampling_stops(tmp_path, sdk_env, tiny_engine, tinker_cli_env,
                                         noticed_by):
    quick = {"unpolled": {"unpolled_s": 2.0},
             "session_timeout": {"session_timeout_s": 2.0}}[noticed_by]
    with Served(tiny_engine, tmp_path, hold_s=2.0, reap_every_s=0.5, **quick) as served:
        client = subprocess.Popen([sys.executable, "-c", GONE_CLIENT, served.url],
                                  env=tinker_cli_env, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while not len(served.service.running) and time.monotonic() < deadline:
                assert client.poll() is None, client.stderr.read()[-2000:]
                time.sleep(0.1)
            assert len(served.service.running) == 1, "the 2048-sample request never came"
            time.sleep(1.0)          # well into its decode
        finally:
            client.kill()
            client.communicate(timeout=30)
        service = tinker.ServiceClient(base_url=served.url)
        sc = service.create_sampling_client(base_model="tiny-random").result()
        t0 = time.monotonic()
        res = sc.sample(types.ModelInput.from_ints([5, 6]), 1,
                        types.SamplingParams(max_tokens=4)).result(timeout=120)
        waited = time.monotonic() - t0
        assert len(res.sequences) == 1 and waited < 30, waited  # the decode takes minutes
        assert not len(served.service.running)
        service.close("success").result()


def test_a_killed_clients_sampling_stops_when_its_poll_hangs_up(tmp_path, sdk_env, tiny_engine,
                                                                tinker_cli_env):
    """No session timeout and no sweep for unpolled futures here: the killed client's poll,
    held open when it died, is the read that notices, and its decode stops at once rather
    than after the minutes it takes or at session end."""
    never = 3600.0
    with Served(tiny_engine, tmp_path, reap_every_s=never, unpolled_s=never,
                session_timeout_s=never) as served:
        running = served.service.running
        client = subprocess.Popen([sys.executable, "-c", GONE_CLIENT, served.url],
                                  env=tinker_cli_env, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while not any(served.service.futures.polls(r) for r in running) \
                    and time.monotonic() < deadline:
                assert client.poll() is None, client.stderr.read()[-2000:]
                time.sleep(0.05)
            [rid] = list(running)
            assert served.service.futures.polls(rid) == 1, "no poll was held on the request"
        finally:
            client.kill()
            client.communicate(timeout=30)
        deadline = time.monotonic() + 120  # its decode takes minutes: never its natural end
        while len(running) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not len(running) and running.stopped == 1  # cancelled, not finished


def test_a_slow_request_polled_all_along_is_not_cancelled(tmp_path, sdk_env):
    """Each poll is held 0.5 s and the SDK polls again at once, so a request that takes
    2.5 s is never 1 s without a poll open on it."""
    engine = BigramEngine(delay_s=2.5)
    with Served(engine, tmp_path, hold_s=0.5, reap_every_s=0.2, unpolled_s=1.0) as served:
        service = tinker.ServiceClient(base_url=served.url)
        sc = service.create_sampling_client(base_model="bigram-test").result()
        res = sc.sample(types.ModelInput.from_ints([1]), 3,
                        types.SamplingParams(max_tokens=3)).result(timeout=60)
        assert len(res.sequences) == 3
        service.close("success").result()


def test_stopping_the_server_stops_its_samples(tmp_path, tiny_engine):
    """Nobody can read a sample once the server is gone: stopping it (the end of Ctrl-C)
    stops the decode, which would otherwise hold the process for minutes."""
    import httpx

    from tests.serve_doubles import KEY

    h = {"X-API-Key": KEY}
    with Served(tiny_engine, tmp_path, hold_s=2.0) as served:
        r = httpx.post(f"{served.url}/api/v1/asample", headers=h, json={
            "num_samples": 2048, "base_model": "tiny-random",
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
            "sampling_params": {"max_tokens": 256, "seed": 1}})
        assert r.status_code == 200, r.text
        time.sleep(1.0)
        assert len(served.service.running) == 1
    t0 = time.monotonic()
    tiny_engine.sample(None, [5, 6], 1, SamplingParams(max_tokens=4), False)
    assert time.monotonic() - t0 < 30       # the model is free again, not minutes later

"""A request whose client is gone leaves `retrain serve`'s decode batch at the next step, on
the OpenAI routes (a client that gave up on its reply, a stream closed part-way) as on the
Tinker ones, while the requests decoded with it go on unchanged; and the sampling a server takes
on at once is bounded: past it, a 429 in each API's own error shape."""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("torch")

from retrain.backends.base import SamplingParams  # noqa: E402
from retrain.serve.engine import EngineError  # noqa: E402
from retrain.serve.openai.routes import OpenAIServing  # noqa: E402
from tests.run_helpers import wait_until  # noqa: E402
from tests.serve_doubles import KEY, Served  # noqa: E402

BIG = {"model": "tiny-random", "prompt": ["one two", "three four"], "n": 64,
       "max_tokens": 1000, "temperature": 1.0}


def _serving(engine) -> OpenAIServing:
    return OpenAIServing(engine.model.tokenizer, frozenset(engine.model.eos_ids))


def test_a_cancelled_request_leaves_the_batch_at_the_next_step(tiny_engine):
    """Two seeded requests decoded in one batch; one is cancelled by its third token: its rows
    leave there (3 tokens each), the other's completions are those it gets alone (float32)."""
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=11)
    alone = tiny_engine.sample(None, [5, 6, 7], 2, params, False).sequences
    cancel = threading.Event()
    heard = {0: 0, 1: 0}

    def on_token(i, token, logprob, top):
        heard[i] += 1
        if heard[i] == 3:
            cancel.set()

    with ThreadPoolExecutor(2) as pool:
        with tiny_engine.model.lock:  # the model is busy: both requests queue as one batch
            leaving = pool.submit(tiny_engine.sample, None, [8, 9, 10], 2, params, False,
                                  cancel, on_token=on_token)
            staying = pool.submit(tiny_engine.sample, None, [5, 6, 7], 2, params, False)
            wait_until(lambda: [len(q) for q in list(tiny_engine._queued.values())] == [2],
                       60, "both requests in one queue")
        with pytest.raises(EngineError, match="cancelled"):
            leaving.result(timeout=120)
        stayed = staying.result(timeout=120).sequences
    assert heard == {0: 3, 1: 3}
    assert [c.tokens for c in stayed] == [c.tokens for c in alone]
    for got, want in zip(stayed, alone, strict=True):  # another batch: the last bits move
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_a_batch_every_client_left_frees_its_cache_at_once(tiny_engine):
    """Not at the garbage collector's next pass: the stopped batch's error must not hold the
    decode's frames (and their KV cache) in a reference cycle. A server that kept them held
    gigabytes after abandoned requests (bench/RESULTS.md)."""
    import gc

    from transformers import DynamicCache

    cancel = threading.Event()
    gc.collect()
    gc.disable()
    try:
        with pytest.raises(EngineError):
            tiny_engine.sample(None, [5, 6, 7], 4, SamplingParams(max_tokens=50), False,
                               cancel, on_token=lambda *heard: cancel.set())
        alive = [o for o in gc.get_objects() if isinstance(o, DynamicCache)]
    finally:
        gc.enable()
    assert alive == []


def test_a_client_that_hangs_up_before_its_reply_is_dropped(tiny_engine, tmp_path):
    """The client closes its connection while its request waits for the busy model: the
    server hears it, and the request never decodes."""
    with Served(tiny_engine, tmp_path, openai=_serving(tiny_engine)) as served:
        running = served.service.running
        body = json.dumps(BIG).encode()
        host, port = served.url.removeprefix("http://").rsplit(":", 1)
        with tiny_engine.model.lock:
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                             b"content-type: application/json\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                wait_until(lambda: len(running) == 1, 60, "the request taken on")
            wait_until(lambda: running.cancelled() == 1, 60, "the request marked cancelled")
        wait_until(lambda: not len(running), 60, "the request to end")
        assert running.stopped == 1 and served.service.backlog.requests == 0


def test_a_stream_closed_part_way_leaves_the_batch(tiny_engine, tmp_path, caplog):
    with Served(tiny_engine, tmp_path, openai=_serving(tiny_engine)) as served, \
            openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0) as client:
        running = served.service.running
        stream = client.completions.create(**BIG, stream=True)
        for i, _ in enumerate(stream):
            if i == 2:
                break
        stream.close()
        wait_until(lambda: not len(running), 120, "the stream's request to end")
        assert running.stopped == 1 and served.service.backlog.requests == 0
        small = client.completions.create(model="tiny-random", prompt="hi", max_tokens=4)
        assert small.choices[0].finish_reason in ("stop", "length")
    assert "socket.send() raised exception" not in caplog.text


def test_sampling_past_the_bound_is_a_429_in_each_apis_shape(tiny_engine, tmp_path):
    """With 1000 tokens queued at most, a request queued behind the busy model fills the
    backlog; the next one, of either API, is refused until it is done."""
    with Served(tiny_engine, tmp_path, openai=_serving(tiny_engine),
                max_queued_tokens=1000) as served, ThreadPoolExecutor(1) as pool, \
            openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0) as client:
        small = {"model": "tiny-random", "prompt": [5, 6, 7], "max_tokens": 4}
        with tiny_engine.model.lock:
            first = pool.submit(client.completions.create, **{**small, "n": 100})  # 700 tokens
            wait_until(lambda: served.service.backlog.requests == 1, 60, "the first request")
            with pytest.raises(openai.RateLimitError) as err:
                client.completions.create(**{**small, "n": 50})
            tinker = httpx.post(f"{served.url}/api/v1/asample", headers={"X-API-Key": KEY},
                                json={"num_samples": 50, "base_model": "tiny-random",
                                      "prompt": {"chunks": [{"type": "encoded_text",
                                                             "tokens": [5, 6, 7]}]},
                                      "sampling_params": {"max_tokens": 4}})
        assert len(first.result(timeout=120).choices) == 100
        assert err.value.code == "rate_limit_exceeded" and "--max-queued-tokens" in \
            err.value.message and err.value.response.headers["retry-after"] == "1"
        assert tinker.status_code == 429 and "--max-queued-tokens" in tinker.json()["error"]
        wait_until(lambda: served.service.backlog.requests == 0, 60, "the backlog to empty")
        again = client.completions.create(**{**small, "n": 50})
        assert len(again.choices) == 50

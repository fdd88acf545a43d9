"""Invalid requests to `retrain serve`: each is a 400 (or 413) that names the field, the SDK
raises it at once instead of retrying, and the server stays up. Plus `retrain serve`'s own
start-up errors: one clear line, exit status 2, no traceback."""

from __future__ import annotations

import concurrent.futures
import contextvars
import itertools
import math
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")
from tinker import types  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402

from tests import warm  # noqa: E402
from tests.serve_doubles import KEY, BigramEngine, Served  # noqa: E402

H = {"X-API-Key": KEY}
PROTO = {**H, "Content-Type": "application/x-protobuf"}


class NanMetricsEngine(BigramEngine):
    """An optimizer step whose metrics are not finite (a diverged run)."""

    def optim_step(self, model_id, adam):
        return {**super().optim_step(model_id, adam), "grad_norm:mean": math.nan}


@pytest.fixture
def served(tmp_path, sdk_env):
    with Served(NanMetricsEngine(), tmp_path, hold_s=2.0, max_body_bytes=200_000) as s:
        s.session = httpx.post(f"{s.url}/api/v1/create_session", headers=H, json={
            "tags": [], "user_metadata": {}, "sdk_version": "x"}).json()["session_id"]
        fut = httpx.post(f"{s.url}/api/v1/create_model", headers=H, json={
            "session_id": s.session, "model_seq_id": 0, "base_model": "bigram-test",
            "lora_config": {"rank": 2}}).json()
        s.model_id = fut["model_id"]
        httpx.post(f"{s.url}/api/v1/retrieve_future", headers=H,
                   json={"request_id": fut["request_id"]})
        yield s
        assert httpx.get(f"{s.url}/api/v1/healthz", headers=H).json() == {"status": "ok"}


def _post(served, route, body):
    return httpx.post(f"{served.url}/api/v1/{route}", headers=H, json=body)


GOOD_PARAMS = {"max_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": -1}

SAMPLE_CASES = [  # (request changes, sampling_params changes, words the error must hold)
    ({"num_samples": 0}, {}, "num_samples"),
    ({"num_samples": -3}, {}, "num_samples"),
    ({"num_samples": 10**6}, {}, "num_samples"),
    ({}, {"top_p": 0.0}, "top_p"),
    ({}, {"top_p": 1.5}, "top_p"),
    ({}, {"top_k": 5}, "top_k"),
    ({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 99]}]}}, {}, "prompt"),
    ({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [-1]}]}}, {}, "prompt"),
    ({}, {"stop": [5000]}, "SamplingParams.stop"),
    ({}, {"seed": 10**30}, "seed"),
    ({}, {"seed": -1}, "seed"),
    ({}, {"max_tokens": 10_000}, "max_tokens"),
    ({}, {"max_tokens": 0}, "max_tokens"),
    ({}, {"temperature": -1.0}, "temperature"),
    ({"topk_prompt_logprobs": 5}, {}, "topk_prompt_logprobs"),
    ({"target_prompt_logprobs": {"data": [0.0], "dtype": "float32"}}, {},
     "target_prompt_logprobs"),
]


@pytest.mark.parametrize("changes,params,field", SAMPLE_CASES)
def test_bad_sample_requests_are_400_naming_the_field(served, changes, params, field):
    body = {"num_samples": 2, "base_model": "bigram-test",
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
            "sampling_params": {**GOOD_PARAMS, **params}, **changes}
    r = _post(served, "asample", body)
    assert r.status_code == 400 and field in r.json()["error"], r.text
    assert r.json()["category"] == "user"


def test_nan_temperature_is_400(served):
    text = ('{"num_samples": 1, "base_model": "bigram-test", "prompt": {"chunks": '
            '[{"type": "encoded_text", "tokens": [1]}]}, "sampling_params": '
            '{"max_tokens": 2, "temperature": NaN}}')
    r = httpx.post(f"{served.url}/api/v1/asample", headers={**H, "Content-Type":
                                                             "application/json"}, content=text)
    assert r.status_code == 400 and "temperature" in r.json()["error"], r.text


@pytest.mark.parametrize("adam,field", [
    ({"learning_rate": -0.1}, "learning_rate"),
    ({"beta1": 1.0}, "beta1"),
    ({"beta2": -0.5}, "beta2"),
    ({"eps": 0.0}, "eps"),
    ({"weight_decay": -1.0}, "weight_decay"),
])
def test_bad_optimizer_settings_are_400(served, adam, field):
    r = _post(served, "optim_step", {"model_id": served.model_id, "seq_id": 1,
                                     "adam_params": {"learning_rate": 0.1, **adam}})
    assert r.status_code == 400 and f"adam_params.{field}" in r.json()["error"], r.text


def _fwdbwd(served, datum: pb.Datum, loss_fn="importance_sampling", **config) -> httpx.Response:
    msg = pb.ForwardBackwardRequest(model_id=served.model_id, seq_id=1, loss_fn=loss_fn)
    msg.data.append(datum)
    for key, value in config.items():
        msg.loss_fn_config[key] = value
    return httpx.post(f"{served.url}/api/v1/forward_backward", headers=PROTO,
                      content=msg.SerializeToString())


def _tensor(values, dtype=pb.DTYPE_FLOAT32, raw: bytes | None = None) -> pb.Tensor:
    np_type = np.float32 if dtype == pb.DTYPE_FLOAT32 else np.int64
    data = raw if raw is not None else np.asarray(values, dtype=np_type).tobytes()
    return pb.Tensor(dense=data, dtype=dtype, shape=[len(values)])


def _datum(tokens=(1, 2), targets=(2, 3), logprobs=(-1.0, -1.0), adv=(1.0, 1.0),
           token_bytes: bytes | None = None, logprob_bytes: bytes | None = None) -> pb.Datum:
    d = pb.Datum()
    chunk = d.model_input.add()
    chunk.encoded_text.tokens = token_bytes if token_bytes is not None else \
        np.asarray(tokens, dtype=np.int32).tobytes()
    d.loss_fn_inputs["target_tokens"].CopyFrom(_tensor(targets, pb.DTYPE_INT64))
    d.loss_fn_inputs["logprobs"].CopyFrom(_tensor(logprobs, raw=logprob_bytes))
    d.loss_fn_inputs["advantages"].CopyFrom(_tensor(adv))
    return d


@pytest.mark.parametrize("datum,field", [
    (_datum(adv=(math.nan, 1.0)), "advantages"),
    (_datum(logprobs=(math.inf, -1.0)), "logprobs"),
    (_datum(targets=(2, 70)), "target_tokens"),
    (_datum(tokens=(1, 99)), "model_input"),
    (_datum(logprob_bytes=b"\x00" * 5), "logprobs"),
    (_datum(token_bytes=b"\x01\x00\x00"), "encoded_text"),
    (_datum(tokens=(), targets=(), logprobs=(), adv=()), "empty"),
])
def test_bad_forward_backward_data_is_400(served, datum, field):
    r = _fwdbwd(served, datum)
    assert r.status_code == 400 and field in r.json()["error"], r.text


def test_bad_loss_config_and_garbage_bodies_are_400(served):
    r = _fwdbwd(served, _datum(), clip_low_threshold=math.nan)
    assert r.status_code == 400 and "clip_low_threshold" in r.json()["error"]
    r = httpx.post(f"{served.url}/api/v1/forward_backward", headers=PROTO, content=b"\xff" * 50)
    assert r.status_code == 400 and "ForwardBackwardRequest" in r.json()["error"]
    r = httpx.post(f"{served.url}/api/v1/asample", headers=H, content=b"{not json")
    assert r.status_code == 400 and "asample" in r.json()["error"]


def test_body_size_is_capped(served):
    r = httpx.post(f"{served.url}/api/v1/telemetry", headers=H, content=b"x" * 300_000)
    assert r.status_code == 413 and "200000 bytes" in r.json()["error"]

    def chunks():  # no Content-Length: the cap applies while reading
        for _ in range(30):
            yield b"x" * 10_000

    r = httpx.post(f"{served.url}/api/v1/asample", headers=H, content=chunks())
    assert r.status_code == 413


def test_the_sdk_raises_bad_requests_at_once_and_nan_metrics_reach_it(served):
    service = tinker.ServiceClient(base_url=served.url)
    tc = service.create_lora_training_client(base_model="bigram-test", rank=2).result()
    sc = tc.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.BadRequestError, match="top_p"):
        sc.sample(types.ModelInput.from_ints([1]), 1,
                  types.SamplingParams(max_tokens=2, top_p=0.0)).result()
    bad = [types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                       loss_fn_inputs={"target_tokens": [2, 3], "logprobs": [-1.0, -1.0],
                                       "advantages": [math.nan, 1.0]})]
    with pytest.raises(tinker.BadRequestError, match="advantages"):
        tc.forward_backward(bad, "importance_sampling").result()
    tc2 = service.create_lora_training_client(base_model="bigram-test", rank=2).result()
    step = tc2.optim_step(types.AdamParams(learning_rate=0.1)).result()  # NaN in the reply
    assert math.isnan(step.metrics["grad_norm:mean"])
    with pytest.raises(tinker.BadRequestError, match="learning_rate"):
        tc2.optim_step(types.AdamParams(learning_rate=-1.0)).result()
    service.close("success").result()


@pytest.mark.parametrize("args,words", [
    (["--port", "70000"], "not a TCP port"),
    (["--host", "999.1.1.1"], "cannot listen on --host '999.1.1.1'"),
    (["--port", "{busy}"], "is in use"),
])
def test_retrain_serve_start_errors_are_one_line(cli_env, python, tmp_path, args, words):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = str(busy.getsockname()[1])
    try:
        argv = [a.replace("{busy}", port) for a in args]
        proc = warm.run([python, "-m", "retrain", "serve", "--model", "tiny-random",
                         *argv], env={**cli_env, "RETRAIN_SERVE_DIR": str(tmp_path)},
                        capture_output=True, text=True, timeout=60)
    finally:
        busy.close()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert words.replace("{busy}", port) in proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 2, proc.stderr


# ------------------------------------------- zstd bodies: capped while decompressing (S4, S5)

ZSTD = {**PROTO, "Content-Encoding": "zstd"}


def _zstd_post(served, body: bytes) -> httpx.Response:
    return httpx.post(f"{served.url}/api/v1/forward_backward", headers=ZSTD, content=body)


def _good_request(served) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=served.model_id, seq_id=1,
                                    loss_fn="importance_sampling")
    msg.data.append(_datum())
    return msg.SerializeToString()


def test_zstd_bomb_is_413_without_inflating(served):
    import zstandard

    # 20 MB of zeros compress to a few hundred bytes; the cap (200 kB) is on what it inflates to
    bomb = zstandard.ZstdCompressor().compress(b"\x00" * 20_000_000)
    assert len(bomb) < 200_000
    r = _zstd_post(served, bomb)
    assert r.status_code == 413 and "200000 bytes" in r.json()["error"], r.text
    stream = zstandard.ZstdCompressor().compressobj()  # a frame with no declared size
    unsized = stream.compress(b"\x00" * 20_000_000) + stream.flush()
    assert zstandard.get_frame_parameters(unsized).content_size == zstandard.CONTENTSIZE_UNKNOWN
    r = _zstd_post(served, unsized)
    assert r.status_code == 413, r.text


@pytest.mark.parametrize("body,words", [
    (b"\xff" * 50, "zstd"),
    (b"", "empty"),
    (b"(\xb5/\xfd", "zstd"),  # a frame's magic number and nothing else
], ids=["garbage", "empty", "magic-only"])
def test_malformed_zstd_is_400(served, body, words):
    r = _zstd_post(served, body)
    assert r.status_code == 400 and words in r.json()["error"], r.text


def test_truncated_zstd_frame_is_400(served):
    import zstandard

    frame = zstandard.ZstdCompressor().compress(_good_request(served))
    r = _zstd_post(served, frame[:-4])
    assert r.status_code == 400 and "zstd" in r.json()["error"], r.text


def test_zstd_frame_without_content_size_is_accepted(served):
    import zstandard

    stream = zstandard.ZstdCompressor().compressobj()  # what streaming clients send
    body = stream.compress(_good_request(served)) + stream.flush()
    r = _zstd_post(served, body)
    assert r.status_code == 200 and "request_id" in r.json(), r.text
    sized = zstandard.ZstdCompressor().compress(_good_request(served))
    assert _zstd_post(served, sized).status_code == 200


# ----------------------------------------------------- a seeded request is reproducible (item 7)

def test_a_seeded_request_gives_the_same_tokens_alone_and_under_load(cli_env, python, tmp_path,
                                                                     sdk_env):
    """`retrain serve` as users start it (dtype auto): a seeded request's tokens do not depend
    on which other requests (other prompts, lengths, seeds, unseeded) are decoded with it."""
    from tests.run_helpers import read_serve_url

    env = {**cli_env, "RETRAIN_SERVE_DIR": str(tmp_path / "state"), "RETRAIN_SERVE_API_KEY": KEY}
    proc = warm.Popen([python, "-m", "retrain", "serve", "--model", "tiny-random",
                       "--port", "0"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = read_serve_url(proc, 120)
        service = tinker.ServiceClient(base_url=url)
        sc = service.create_sampling_client(base_model="tiny-random")
        prompt = types.ModelInput.from_ints([1, 5, 6])

        def params(seed=None):
            return types.SamplingParams(max_tokens=16, temperature=1.0, seed=seed)

        for seed in range(6):
            alone = sc.sample(prompt, 3, params(seed)).result()
            crowd = [sc.sample(types.ModelInput.from_ints(list(range(3, 3 + 9 * j))), 3,
                               params(None if j % 2 else seed + j)) for j in range(1, 7)]
            crowd += [sc.sample(types.ModelInput.from_ints([7, 8, 9 + j]), 3, params(seed + j))
                      for j in range(3)]
            loaded = sc.sample(prompt, 3, params(seed))
            [f.result() for f in crowd]
            assert [s.tokens for s in loaded.result().sequences] == \
                [s.tokens for s in alone.sequences], seed
        service.close("success").result()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


# ------------------------------------------------------------------ retries release the slot

RETRY_SLEEPERS = {  # the SDK's functions that sleep before sending a request again
    "_sleep_for_retry", "execute_with_retries", "_execute_with_retry", "_sample_async_impl",
    "_handle_transport_error"}
CALL = contextvars.ContextVar("test_backend_call", default=None)


def _sdk_retry_sleep() -> bool:
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        if frame.f_code.co_name in RETRY_SLEEPERS:
            return True
        frame = frame.f_back
    return False


class HoldLog:
    """The real file semaphore, recording each slot hold as (call, start, end). A call is one
    `TinkerCalls.call`, named by the CALL context variable the test sets around it."""

    def __init__(self, sem):
        self.sem = sem
        self.wait_s = 0.0
        self.holds: list[tuple[int, float, float]] = []
        self._mine = threading.local()

    def __enter__(self):
        self.sem.__enter__()
        self._mine.started = (CALL.get(), time.monotonic())
        return self

    def __exit__(self, *exc):
        call, start = self._mine.started
        self.holds.append((call, start, time.monotonic()))
        self.sem.__exit__(*exc)

    def record(self, completions=0, tokens=0):
        self.sem.record(completions, tokens)

    def record_error(self, status):
        self.sem.record_error(status)


def test_no_slot_is_held_while_its_holder_sleeps_on_429(tmp_path, cli_env, python, monkeypatch):
    """Three backends share one API slot (the real file semaphore) against a `retrain serve`
    process that answers 429 to a third of sample, forward_backward, optim_step and result
    polls. The SDK backs off and sends again (training requests under their seq_id), and
    every such sleep is slot-free: no call holds a slot while it sleeps. Every step still
    lands exactly once (the optimizer's step count in each adapter's saved state)."""
    import asyncio

    import anyio
    import torch

    from retrain.backends.base import AdamParams, LossConfig, SamplingParams, make_datum
    from retrain.backends.tinker.backend import TinkerBackend
    from retrain.backends.tinker.calls import TinkerCalls
    from retrain.slots.file_slots import CountingSemaphore
    from tests.run_helpers import read_serve_url

    sleeps: list[tuple[int, float, float]] = []

    def recorded(real):
        async def sleep(delay, *args, **kwargs):
            call = CALL.get()
            if call is None or not delay or not _sdk_retry_sleep():
                return await real(delay, *args, **kwargs)
            start = time.monotonic()
            try:
                return await real(delay, *args, **kwargs)
            finally:
                sleeps.append((call, start, time.monotonic()))
        return sleep

    monkeypatch.setattr(asyncio, "sleep", recorded(asyncio.sleep))
    monkeypatch.setattr(anyio, "sleep", recorded(anyio.sleep))
    calls = itertools.count(1)
    real_call = TinkerCalls.call

    def named_call(self, *args, **kwargs):
        token = CALL.set(next(calls))
        try:
            return real_call(self, *args, **kwargs)
        finally:
            CALL.reset(token)

    monkeypatch.setattr(TinkerCalls, "call", named_call)
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    slots = HoldLog(CountingSemaphore(tmp_path / "slots", 1))
    state_dir = tmp_path / "serve-state"
    env = {**cli_env, "RETRAIN_SERVE_DIR": str(state_dir), "RETRAIN_SERVE_FAULTS":
           "429=0.34,seed=5,after=4,routes=asample+forward_backward+optim_step+retrieve_future"}
    serve = warm.Popen([python, "-m", "retrain", "serve", "--model", "tiny-random",
                        "--port", "0", "--dtype", "float32", "--api-key", KEY],
                       env=env, stderr=subprocess.PIPE, text=True)
    steps = 3
    try:
        url = read_serve_url(serve, 120)

        def holder(seed: int) -> str:
            backend = TinkerBackend(base_model="tiny-random", lora_rank=2, seed=seed,
                                    base_url=url, request_timeout_s=120, slots=slots)
            try:
                prompt = backend.tokenizer.encode("ab")
                for _ in range(steps):
                    comps = backend.sample([prompt], 4, SamplingParams(max_tokens=4,
                                                                       seed=seed))[0]
                    datums = [make_datum(prompt, c, 0.5 - i % 2) for i, c in enumerate(comps)]
                    backend.forward_backward(datums, LossConfig(name="importance_sampling"))
                    backend.optim_step(AdamParams(learning_rate=0.01))
                return backend.save_state("final")
            finally:
                backend.close()

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            saved = list(pool.map(holder, [1, 2, 3]))
    finally:
        serve.terminate()
        serve.wait(timeout=60)
    for path in saved:  # each step exactly once, however often its requests were refused
        folder = state_dir / "runs" / path.removeprefix("tinker://")
        adam = torch.load(folder / "optimizer.pt", weights_only=True)["state"]
        assert adam and {int(p["step"]) for p in adam.values()} == {steps}, path
    assert len(sleeps) >= 5, sleeps
    overlaps = [(s, h) for s in sleeps for h in slots.holds
                if s[0] == h[0] and h[1] < s[2] and s[1] < h[2]]
    assert not overlaps, f"{len(overlaps)} of {len(sleeps)} sleeps held their call's slot"

"""`retrain serve` against the unmodified tinker SDK, over a bigram engine double.

The bigram double (tests/serve_doubles.py: numpy, analytic gradients) makes the HTTP /
protobuf / futures / ordering layer testable in milliseconds; the same SDK flows then
run over the real local engine.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from retrain.backends.base import SamplingParams  # noqa: E402
from retrain.serve.door.guard import FaultPlan  # noqa: E402
from tests import warm  # noqa: E402
from tests.run_helpers import read_serve_url  # noqa: E402
from tests.serve_doubles import KEY, BigramEngine, Served  # noqa: E402


@pytest.fixture
def bigram_server(tmp_path, sdk_env):
    with Served(BigramEngine(), tmp_path, hold_s=2.0) as served:
        yield served


def _datum(prompt, completion, sampled_lp, adv):
    tokens = list(prompt) + list(completion)
    n_prompt = len(prompt) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * n_prompt + list(sampled_lp),
            "advantages": [0.0] * n_prompt + [adv] * len(completion),
        })


# ------------------------------------------------------------------------------ SDK flows


def test_sdk_full_loop_save_and_load_state(bigram_server):
    """Create, sample, forward_backward(IS), optim_step, save, load into a new client, sample."""
    service = tinker.ServiceClient(base_url=bigram_server.url)
    tc = service.create_lora_training_client(base_model="bigram-test", rank=4, seed=1).result()
    assert tc.get_info().lora_rank == 4
    sc = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([3, 4])
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    res = sc.sample(prompt, num_samples=4, sampling_params=params).result()
    assert len(res.sequences) == 4
    seq = res.sequences[0]
    assert len(seq.tokens) == len(seq.logprobs) and seq.stop_reason in ("stop", "length")
    data = [_datum([3, 4], s.tokens, s.logprobs, 1.0 if i % 2 else -1.0)
            for i, s in enumerate(res.sequences)]
    fb = tc.forward_backward(data, "importance_sampling")
    opt = tc.optim_step(types.AdamParams(learning_rate=0.05))
    out, step = fb.result(), opt.result()
    assert len(out.loss_fn_outputs) == 4
    for d, o in zip(data, out.loss_fn_outputs, strict=True):
        assert o["logprobs"].shape == [d.model_input.length]
        # on-policy: the trainer's target logprobs equal the sampler's on sampled tokens
        got = np.asarray(o["logprobs"].data)[1:]
        want = np.asarray(d.loss_fn_inputs["logprobs"].data)[1:]
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert "loss:sum" in out.metrics and step.metrics["grad_norm:mean"] > 0

    saved = tc.save_state("ckpt-1").result().path
    assert saved.startswith("tinker://") and saved.endswith("/weights/ckpt-1")
    sampler_path = tc.save_weights_for_sampler("samp-1").result().path
    before = bigram_server.engine.snapshot(tc.model_id)

    tc2 = service.create_training_client_from_state_with_optimizer(saved).result()
    assert tc2.model_id != tc.model_id
    a, b = bigram_server.engine.adapters[tc.model_id], bigram_server.engine.adapters[tc2.model_id]
    np.testing.assert_array_equal(a["w"], b["w"])
    np.testing.assert_array_equal(a["m"], b["m"])
    assert b["t"] == 1
    sc2 = service.create_sampling_client(model_path=sampler_path).result()
    res2 = sc2.sample(prompt, num_samples=2, sampling_params=params).result()
    assert len(res2.sequences) == 2
    np.testing.assert_array_equal(before, bigram_server.engine.snapshot(tc.model_id))
    lps = sc2.compute_logprobs(types.ModelInput.from_ints([3, 4, 5])).result()
    assert lps[0] is None and len(lps) == 3 and lps[2] < 0
    service.close("success").result()


def test_training_ops_run_in_seq_order_and_learn(bigram_server):
    """Pipelined fwd/bwd + optim over many steps: executed strictly in order; reward rises."""
    service = tinker.ServiceClient(base_url=bigram_server.url)
    tc = service.create_lora_training_client(base_model="bigram-test", rank=2, seed=0).result()
    target = 5
    params = types.SamplingParams(max_tokens=4, temperature=1.0)
    prompt = types.ModelInput.from_ints([2])
    rewards = []
    for _ in range(25):
        sc = tc.save_weights_and_get_sampling_client().result()
        res = sc.sample(prompt, num_samples=16, sampling_params=params).result()
        r = [float(np.mean([t == target for t in s.tokens])) for s in res.sequences]
        rewards.append(np.mean(r))
        mean = np.mean(r)
        data = [_datum([2], s.tokens, s.logprobs, ri - mean)
                for s, ri in zip(res.sequences, r, strict=True)]
        futures = [tc.forward_backward(data, "ppo"), tc.optim_step(
            types.AdamParams(learning_rate=0.3))]
        [f.result() for f in futures]
    assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.2
    ops = [op for op, mid in bigram_server.engine.calls if mid == tc.model_id]
    assert ops == ["forward_backward", "optim_step"] * 25
    service.close("success").result()


def test_two_training_clients_share_the_engine(bigram_server):
    service = tinker.ServiceClient(base_url=bigram_server.url)
    a = service.create_lora_training_client(base_model="bigram-test", rank=2, seed=1).result()
    b = service.create_lora_training_client(base_model="bigram-test", rank=2, seed=2).result()
    assert a.model_id != b.model_id
    data = [_datum([1, 2], [3, 4], [-1.0, -1.0], 1.0)]
    a.forward_backward(data, "importance_sampling").result()
    a.optim_step(types.AdamParams(learning_rate=0.5)).result()
    eng = bigram_server.engine
    assert not np.allclose(eng.adapters[a.model_id]["w"], eng.adapters[b.model_id]["w"])
    assert eng.adapters[b.model_id]["t"] == 0
    service.close("success").result()
    deadline = time.time() + 5
    while eng.adapters and time.time() < deadline:  # finish frees the session's adapters
        time.sleep(0.05)
    assert not eng.adapters


def test_errors_are_clear(bigram_server):
    service = tinker.ServiceClient(base_url=bigram_server.url)
    with pytest.raises(tinker.BadRequestError, match="this server serves 'bigram-test'"):
        service.create_lora_training_client(base_model="Qwen/Qwen3-8B").result()
    tc = service.create_lora_training_client(base_model="bigram-test", rank=2).result()
    bad = [types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                       loss_fn_inputs={"target_tokens": [2, 3]})]
    with pytest.raises(tinker.BadRequestError, match="needs loss_fn_inputs\\['logprobs'\\]"):
        tc.forward_backward(bad, "importance_sampling").result()
    with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
        service.create_training_client_from_state("tinker://nope/weights/x").result()
    service.close("success").result()


def test_unknown_route_and_key_check(tmp_path, sdk_env):
    import httpx

    with Served(BigramEngine(), tmp_path, api_key=KEY) as served:
        r = httpx.post(f"{served.url}/api/v1/no_such_route", json={},
                       headers={"X-API-Key": KEY})
        assert r.status_code == 404 and "does not implement POST" in r.json()["error"]
        r = httpx.get(f"{served.url}/api/v1/healthz", headers={"X-API-Key": "tml-wrong"})
        assert r.status_code == 401 and KEY not in r.text
        assert httpx.get(f"{served.url}/api/v1/healthz",
                         headers={"X-API-Key": KEY}).json() == {"status": "ok"}
        with tinker.ServiceClient(base_url=served.url, api_key="tml-wrong-key") as service, \
                pytest.raises(tinker.AuthenticationError):
            service.create_lora_training_client(base_model="bigram-test").result()


def test_long_poll_holds_then_try_again(tmp_path, sdk_env):
    """retrieve_future waits for the result instead of answering at once."""
    import httpx

    # Margins wide enough for a loaded 2-core CI box: hold 1 s, each op takes 2.5 s.
    engine = BigramEngine(delay_s=2.5)
    with Served(engine, tmp_path, hold_s=1.0) as served:
        h = {"X-API-Key": KEY}
        sess = httpx.post(f"{served.url}/api/v1/create_session", headers=h,
                          json={"tags": [], "user_metadata": {}, "sdk_version": "x"}).json()
        fut = httpx.post(f"{served.url}/api/v1/create_model", headers=h, json={
            "session_id": sess["session_id"], "model_seq_id": 0, "base_model": "bigram-test",
            "lora_config": {"rank": 2}}).json()
        rid = fut["request_id"]
        t0 = time.monotonic()
        first = httpx.post(f"{served.url}/api/v1/retrieve_future", headers=h,
                           json={"request_id": rid}).json()
        # create_adapter itself is instant, so the first poll already has the result
        assert first["model_id"] == fut["model_id"] and time.monotonic() - t0 < 1.0
        body = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(
                data=[_datum([1], [2], [-1.0], 1.0)], loss_fn="importance_sampling"),
            model_id=fut["model_id"], seq_id=1)
        from tinker.proto.request_conv import forward_backward_request_to_proto

        r = httpx.post(f"{served.url}/api/v1/forward_backward",
                       content=forward_backward_request_to_proto(body).SerializeToString(),
                       headers={**h, "Content-Type": "application/x-protobuf"}).json()
        t0 = time.monotonic()
        again = httpx.post(f"{served.url}/api/v1/retrieve_future", headers=h,
                           json={"request_id": r["request_id"]}).json()
        assert again["type"] == "try_again" and 0.95 < time.monotonic() - t0 < 2.4
        for _ in range(10):
            done = httpx.post(f"{served.url}/api/v1/retrieve_future",
                              headers={**h, "Accept": "application/x-protobuf"},
                              json={"request_id": r["request_id"]})
            if done.headers["content-type"] != "application/json":
                break
        assert done.headers["content-type"] == "application/x-protobuf"
        gone = httpx.post(f"{served.url}/api/v1/retrieve_future", headers=h,
                          json={"request_id": "req-unknown"})
        assert gone.status_code == 410


def test_sampling_runs_concurrently_training_in_order(tmp_path, sdk_env):
    engine = BigramEngine(delay_s=0.5)
    with Served(engine, tmp_path, hold_s=2.0) as served:
        service = tinker.ServiceClient(base_url=served.url)
        sc = service.create_sampling_client(base_model="bigram-test").result()
        params = types.SamplingParams(max_tokens=2)
        t0 = time.monotonic()
        futs = [sc.sample(types.ModelInput.from_ints([1]), 1, params) for _ in range(6)]
        [f.result() for f in futs]
        assert engine.peak >= 3 and time.monotonic() - t0 < 6 * 0.5  # not one at a time
        service.close("success").result()


@pytest.mark.parametrize("fault", ["429", "502", "504"])
def test_sdk_survives_injected_faults(tmp_path, sdk_env, fault):
    plan = FaultPlan(rates={fault: 0.2}, seed=3)
    with Served(BigramEngine(), tmp_path, hold_s=2.0, faults=plan) as served:
        service = tinker.ServiceClient(base_url=served.url)
        tc = service.create_lora_training_client(base_model="bigram-test", rank=2).result()
        for _ in range(3):
            sc = tc.save_weights_and_get_sampling_client().result()
            res = sc.sample(types.ModelInput.from_ints([1]), 4,
                            types.SamplingParams(max_tokens=3)).result()
            data = [_datum([1], s.tokens, s.logprobs, 0.5) for s in res.sequences]
            tc.forward_backward(data, "importance_sampling").result()
            tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
        assert served.traffic.faults.get(fault, 0) >= 3
        ops = [op for op, mid in served.engine.calls if mid == tc.model_id]
        assert ops == ["forward_backward", "optim_step"] * 3  # retries never ran an op twice
        service.close("success").result()


def test_fault_plan_parse():
    plan = FaultPlan.parse("429=0.25,hang=0.5,hang_s=3,seed=2,routes=asample+optim_step")
    assert plan.rates == {"429": 0.25, "hang": 0.5} and plan.hang_s == 3
    assert plan.draw("telemetry") is None and plan.draw("create_model") is None
    drawn = [plan.draw("asample") for _ in range(400)]
    assert 0.15 < drawn.count("429") / 400 < 0.35 and 0.4 < drawn.count("hang") / 400 < 0.6
    with pytest.raises(ValueError):
        FaultPlan.parse("418=0.5")
    once = FaultPlan.parse("502=1,after=2,limit=1")
    assert [once.draw("asample") for _ in range(5)] == [None, None, "502", None, None]


def test_sequencer_orders_and_dedupes():
    from retrain.serve.tinker.ordering import Sequencer

    async def main():
        seq, order = Sequencer(), []

        def job(n):
            async def run():
                await asyncio.sleep(0.01)
                order.append(n)
            return run

        seq.submit(3, "c", job(3))
        seq.submit(2, "b", job(2))
        assert seq.seen(2) == "b" and not seq.idle
        seq.submit(1, "a", job(1))
        with pytest.raises(ValueError):
            seq.submit(2, "again", job(2))
        idle = asyncio.Event()
        seq.when_idle(idle.set)
        await asyncio.wait_for(idle.wait(), 2)
        assert order == [1, 2, 3] and seq.next_seq == 4
        assert seq.submit(None, "d", job(4)) == 4

    asyncio.run(main())


def test_checkpoint_files_are_complete(bigram_server):
    service = tinker.ServiceClient(base_url=bigram_server.url)
    tc = service.create_lora_training_client(base_model="bigram-test", rank=3).result()
    path = tc.save_state("final").result().path
    run_id = path.split("/")[2]
    folder = bigram_server.service.state_dir / "runs" / run_id / "weights" / "final"
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["rank"] == 3 and meta["base_model"] == "bigram-test"
    assert not [p for p in folder.parent.iterdir() if p.name.endswith(".tmp")]
    service.close("success").result()


# ------------------------------------------------------------------------------ the real engine


def test_sdk_over_the_tiny_model(tmp_path, sdk_env, tiny_engine):
    """The brief's flow on the real local engine: LoRA client, sample, IS step, save state,
    load it into a new client, sample from the saved sampler weights."""
    with Served(tiny_engine, tmp_path, hold_s=2.0) as served:
        service = tinker.ServiceClient(base_url=served.url)
        tc = service.create_lora_training_client(base_model="tiny-random", rank=4, seed=3).result()
        tok = tc.get_tokenizer()
        assert tok.eos_token_id == 2 and tc.get_info().model_data.tokenizer_id == \
            tiny_engine.tokenizer_id
        prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                         add_generation_prompt=True, tokenize=True)["input_ids"]
        sc = tc.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=5, stop=[2])
        res = sc.sample(types.ModelInput.from_ints(prompt), 4, params).result()
        assert len(res.sequences) == 4
        data = [_datum(prompt, s.tokens, s.logprobs, 1.0 if i < 2 else -1.0)
                for i, s in enumerate(res.sequences)]
        out = tc.forward_backward(data, "importance_sampling").result()
        for d, o, s in zip(data, out.loss_fn_outputs, res.sequences, strict=True):
            lp = np.asarray(o["logprobs"].data)
            assert lp.shape == (d.model_input.length,)
            np.testing.assert_allclose(lp[-len(s.tokens):], s.logprobs, atol=1e-4)
        step = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert step.metrics["grad_norm"] > 0
        path = tc.save_state("s1").result().path
        sampler_path = tc.save_weights_for_sampler("w1").result().path

        tc2 = service.create_training_client_from_state_with_optimizer(path).result()
        sc_saved = service.create_sampling_client(model_path=sampler_path).result()
        greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
        a = sc_saved.sample(types.ModelInput.from_ints(prompt), 1, greedy).result()
        b = tc2.save_weights_and_get_sampling_client().result().sample(
            types.ModelInput.from_ints(prompt), 1, greedy).result()
        assert a.sequences[0].tokens == b.sequences[0].tokens
        service.close("success").result()
        deadline = time.time() + 5
        left = tiny_engine.model.lora_configs
        while len(left) > 1 and time.time() < deadline:
            time.sleep(0.05)
        assert set(left) == {tiny_engine._sampler.adapter}  # the session's adapters were freed
        assert not served.service.models and not served.service.samplers


def test_exposure_warning():
    from retrain.serve.server import exposure_warning

    assert exposure_warning("127.0.0.1", False) is None
    assert "set --api-key" in exposure_warning("0.0.0.0", False)
    assert "--api-key" not in exposure_warning("0.0.0.0", True)


def test_retrain_serve_command(cli_env, python, tiny_model, tmp_path, sdk_env):
    """`retrain serve` as users start it: a free port, a shared key, the SDK on top."""
    import subprocess

    env = {**cli_env, "RETRAIN_SERVE_DIR": str(tmp_path / "state"),
           "RETRAIN_SERVE_API_KEY": KEY}
    proc = warm.Popen([python, "-m", "retrain", "serve", "--model", "tiny-random",
                       "--port", "0", "--dtype", "float32"], env=env,
                      stderr=subprocess.PIPE, text=True)
    try:
        url = read_serve_url(proc, 60)
        service = tinker.ServiceClient(base_url=url)
        tc = service.create_lora_training_client(base_model="tiny-random", rank=2).result()
        sc = tc.save_weights_and_get_sampling_client().result()
        res = sc.sample(types.ModelInput.from_ints([1, 70]), 2,
                        types.SamplingParams(max_tokens=3)).result()
        assert len(res.sequences) == 2
        service.close("success").result()
        with tinker.ServiceClient(base_url=url, api_key="tml-wrong") as wrong, \
                pytest.raises(tinker.AuthenticationError):
            wrong.create_lora_training_client(base_model="tiny-random").result()
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[1]
    # uvicorn shuts down cleanly on SIGTERM, then re-raises it (exit -15)
    assert proc.returncode in (0, -15) and "Traceback" not in out, out[-2000:]
    assert KEY not in out


def test_queued_samples_are_decoded_in_one_batch(tiny_engine):
    """Requests that pile up while the model is busy share one batched decode."""
    calls = []
    real = tiny_engine._sampler.sample

    def spy(prompts, n, params, **kw):
        calls.append(len(prompts))
        return real(prompts, n, params, **kw)

    tiny_engine._sampler.sample = spy
    try:
        spec = SamplingParams(max_tokens=4, seed=1)
        unseeded = SamplingParams(max_tokens=4)     # batched too: the seeded ones stay the same
        results = {}
        with tiny_engine.model.lock:  # the model is busy (e.g. training)
            threads = [threading.Thread(target=lambda i=i: results.__setitem__(
                i, tiny_engine.sample(None, [1, 70 + i], 3, unseeded if i == 2 else spec,
                                      False))) for i in range(5)]
            [t.start() for t in threads]
            time.sleep(0.3)
        [t.join(10) for t in threads]
    finally:
        del tiny_engine._sampler.sample
    assert calls == [5]
    assert sorted(results) == list(range(5))
    assert all(len(r.sequences) == 3 for r in results.values())
    # a seeded request gets the same completions batched as alone
    for i, r in results.items():
        if i == 2:
            continue
        alone = tiny_engine.sample(None, [1, 70 + i], 3, spec, False)
        assert [s.tokens for s in r.sequences] == [s.tokens for s in alone.sequences]

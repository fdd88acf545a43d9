"""The Tinker backend (official SDK) against `retrain serve` on 127.0.0.1, over the bigram double.

Checks the backend's own duties: the next-token shift on the wire, pipelining, slots per
request (and no deadlock with one slot), exact resume, deadlines, and key hygiene.
"""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest

pytest.importorskip("tinker")

from retrain.backends.base import (  # noqa: E402
    AdamParams,
    BackendError,
    LossConfig,
    SamplingParams,
    make_datum,
)
from retrain.backends.tinker.backend import TinkerBackend  # noqa: E402
from retrain.backends.tinker.rate_limit import QUEUES_429_HEADER  # noqa: E402
from retrain.backends.tinker.sdk import check_sdk  # noqa: E402
from retrain.errors import UserError  # noqa: E402
from retrain.serve.door.guard import FaultPlan  # noqa: E402
from tests.serve_doubles import KEY, BigramEngine, Served  # noqa: E402

EOS = 2  # the tiny tokenizer's <|im_end|>


class CountingSlots:
    """A thread-safe ApiSlots with `n` slots that records how many were held at once."""

    def __init__(self, n: int):
        self._sem = threading.Semaphore(n)
        self._lock = threading.Lock()
        self.wait_s = 0.0
        self.held = 0
        self.peak = 0
        self.entries = 0

    def __enter__(self):
        t0 = time.monotonic()
        self._sem.acquire()
        with self._lock:
            self.wait_s += time.monotonic() - t0
            self.held += 1
            self.entries += 1
            self.peak = max(self.peak, self.held)
        return self

    def __exit__(self, *exc):
        with self._lock:
            self.held -= 1
        self._sem.release()

    def record(self, completions: int = 0, tokens: int = 0) -> None:
        with self._lock:
            self.completions = getattr(self, "completions", 0) + completions

    def record_error(self, status: int) -> None:
        return None


def _engine(tiny_model, **kw):
    return BigramEngine(vocab=260, eos=EOS, tokenizer_id=tiny_model, **kw)


def _backend(url, slots=None, timeout_s=30.0, seed=0):
    return TinkerBackend(base_model="bigram-test", lora_rank=4, seed=seed, base_url=url,
                         request_timeout_s=timeout_s, slots=slots)


def _step(backend, prompt, n=6, lr=0.05, loss="importance_sampling"):
    comps = backend.sample([prompt], n, SamplingParams(max_tokens=5, seed=1))[0]
    rewards = [float(sum(t == 70 for t in c.tokens)) for c in comps]
    mean = sum(rewards) / len(rewards)
    datums = [make_datum(prompt, c, r - mean) for c, r in zip(comps, rewards, strict=True)]
    out = backend.forward_backward(datums, LossConfig(name=loss))
    opt = backend.optim_step(AdamParams(learning_rate=lr))
    return comps, datums, out, opt


def test_version_and_key_checks(monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.37.1" if name == "tinker" else real(name))
    with pytest.raises(UserError, match=r"tinker==0\.38\.0.*0\.37\.1 is installed"):
        check_sdk()
    monkeypatch.undo()
    check_sdk()
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    with pytest.raises(UserError, match=r"\$TINKER_API_KEY"):
        _backend("http://127.0.0.1:9")


def test_sample_train_and_shift_on_the_wire(tmp_path, sdk_env, tiny_model):
    with Served(_engine(tiny_model), tmp_path, hold_s=2.0) as served:
        backend = _backend(served.url)
        assert backend.tokenizer.eos_token_id == EOS
        prompt = backend.tokenizer.encode("ab")
        comps = backend.sample([prompt, prompt + [80]], 3, SamplingParams(max_tokens=8, seed=3))
        assert [len(c) for c in comps] == [3, 3]
        for c in comps[0] + comps[1]:
            assert len(c.tokens) == len(c.logprobs) >= 1
            assert (c.finish_reason == "stop") == (c.tokens[-1] == EOS)
            assert EOS not in c.tokens[:-1]

        seen = []
        real_fb = served.engine.forward_backward

        def spy(model_id, data, loss_fn, config, forward_only):
            seen.append((data, loss_fn, config))
            return real_fb(model_id, data, loss_fn, config, forward_only)

        served.engine.forward_backward = spy
        datums = [make_datum(prompt, c, 0.5) for c in comps[0]]
        out = backend.forward_backward(datums, LossConfig(name="ppo", clip_eps=0.1,
                                                          clip_eps_high=0.3))
        assert len(out.logprobs) == 3
        data, loss_fn, config = seen[0]
        assert loss_fn == "ppo"
        assert config == pytest.approx({"clip_low_threshold": 0.9, "clip_high_threshold": 1.3})
        tokens = sum(sum(d.mask) for d in datums)
        for d, wire, lp in zip(datums, data, out.logprobs, strict=True):
            assert wire.input_tokens == d.input_tokens                # tokens[:-1]
            assert wire.target_tokens == d.target_tokens              # tokens[1:]
            # advantages scaled by 1 / completion tokens of the call (the local token mean)
            np.testing.assert_allclose(np.asarray(wire.advantages) * tokens, d.advantages,
                                       rtol=1e-6)
            np.testing.assert_allclose(wire.logprobs, d.logprobs, atol=1e-6)
            # on-policy: trainer log-probs of completion tokens equal the sampler's
            n = sum(d.mask)
            np.testing.assert_allclose(lp[-int(n):], d.logprobs[-int(n):], atol=1e-5)
        opt = backend.optim_step(AdamParams(learning_rate=0.1))
        assert opt.grad_norm > 0
        backend.close()


def test_pipelined_optim_step_is_queued_before_fwdbwd_finishes(tmp_path, sdk_env, tiny_model):
    engine = _engine(tiny_model, delay_s=0.4)
    with Served(engine, tmp_path, hold_s=2.0) as served:
        backend = _backend(served.url)
        prompt = backend.tokenizer.encode("a")
        comps = backend.sample([prompt], 2, SamplingParams(max_tokens=3))[0]
        arrivals = {}
        real_opt = served.service.optim_step

        def spy(req):
            arrivals["optim"] = time.monotonic()
            return real_opt(req)

        served.service.optim_step = spy
        ends = {}
        real_fb = engine.forward_backward

        def timed(*a):
            out = real_fb(*a)
            ends["fb"] = time.monotonic()
            return out

        engine.forward_backward = timed
        backend.forward_backward([make_datum(prompt, c, 1.0) for c in comps],
                                 LossConfig())
        backend.optim_step(AdamParams(learning_rate=0.1))
        assert arrivals["optim"] < ends["fb"]  # submitted while fwd/bwd was still running
        backend.close()


@pytest.mark.parametrize("n_slots", [1, 2])
def test_every_request_holds_a_slot(tmp_path, sdk_env, tiny_model, n_slots):
    """8 prompts sampled in parallel + pipelined training: the server never sees more
    requests in flight than there are slots, and one slot cannot deadlock."""
    slots = CountingSlots(n_slots)
    with Served(_engine(tiny_model, delay_s=0.05), tmp_path, hold_s=2.0) as served:
        backend = TinkerBackend(base_model="bigram-test", lora_rank=4, seed=0,
                                base_url=served.url, request_timeout_s=30, slots=slots,
                                final_step=100)
        prompt = backend.tokenizer.encode("a")
        served.traffic.reset_peak()
        for step in range(1, 4):
            comps = backend.sample([prompt] * 8, 2, SamplingParams(max_tokens=3))
            datums = [make_datum(prompt, c, 1.0) for group in comps for c in group]
            backend.forward_backward(datums, LossConfig())
            backend.optim_step(AdamParams(learning_rate=0.1))
            backend.save_state(f"step-{step}")  # the third save deletes the first
        backend.close()
        assert slots.held == 0 and slots.entries >= 3 * (8 + 3 + 1) + 1
        assert slots.completions == 3 * 8 * 2   # reported through the slots, for the meter
        assert served.traffic.peak <= n_slots
        if n_slots == 2:
            assert served.engine.peak == 2  # parallel sampling did happen


def test_exact_resume_weights_and_optimizer(tmp_path, sdk_env, tiny_model):
    with Served(_engine(tiny_model), tmp_path, hold_s=2.0) as served:
        prompt = [1, 70, 71]
        a = _backend(served.url, seed=5)
        _step(a, prompt)
        ref = a.save_state("after-1")
        assert ref.startswith("tinker://") and ref.endswith("/weights/after-1")
        _, datums, _, _ = _step(a, prompt)
        want = served.engine.snapshot(a.training.model_id)

        b = _backend(served.url, seed=99)
        b.load_state(ref)
        b.forward_backward(datums, LossConfig())
        b.optim_step(AdamParams(learning_rate=0.05))
        got = served.engine.snapshot(b.training.model_id)
        np.testing.assert_array_equal(got, want)
        a.close()
        b.close()


def test_deadline_turns_a_hang_into_backend_error(tmp_path, sdk_env, tiny_model):
    plan = FaultPlan(rates={"hang": 1.0}, hang_s=20, routes=frozenset({"forward_backward"}))
    with Served(_engine(tiny_model), tmp_path, hold_s=2.0, faults=plan) as served:
        backend = _backend(served.url, timeout_s=1.5)
        prompt = [1, 70]
        comps = backend.sample([prompt], 2, SamplingParams(max_tokens=3))[0]
        t0 = time.monotonic()
        with pytest.raises(BackendError, match="request_timeout_s = 1.5 s.*resumes"):
            out = backend.forward_backward([make_datum(prompt, c, 1.0) for c in comps],
                                           LossConfig())
            backend.optim_step(AdamParams(learning_rate=0.1))
            _ = out.loss
        assert time.monotonic() - t0 < 6
        t0 = time.monotonic()
        with pytest.raises(BackendError, match="timed out earlier"):
            backend.save_state("x")
        assert time.monotonic() - t0 < 1.5  # refused at once, not after another deadline
        backend.close()


def test_api_key_never_in_errors(tmp_path, sdk_env, tiny_model, capfd):
    with Served(_engine(tiny_model), tmp_path, api_key="tml-the-server-key") as served:
        backend = _backend(served.url)
        with pytest.raises(BackendError) as info:
            backend.sample([[1, 2]], 1, SamplingParams(max_tokens=2))
        assert "rejected the API key" in str(info.value)
        assert KEY not in str(info.value) and KEY not in repr(info.value.__cause__)
        backend.close()
    out, err = capfd.readouterr()
    assert KEY not in out and KEY not in err


def test_same_step_as_the_local_backend(tmp_path, sdk_env, tiny_model):
    """Over `retrain serve`, one training step equals the local backend's on the same datums:
    same initial adapter (same seed), same loss, same trainer log-probs, same update."""
    import torch

    from retrain.backends.local.backend import LocalBackend
    from retrain.backends.local.model import LocalModel
    from retrain.serve.local_engine import LocalEngine

    ref_model = LocalModel.load(tiny_model, "float32", "cpu", 1)
    local = LocalBackend.new_adapter(ref_model, "ref", 4, 16.0, 0.0, [], seed=11)
    engine = LocalEngine(LocalModel.load(tiny_model, "float32", "cpu", 1), "tiny-random")
    with Served(engine, tmp_path, hold_s=2.0) as served:
        remote = TinkerBackend(base_model="tiny-random", lora_rank=4, seed=11,
                               base_url=served.url, request_timeout_s=30)
        prompt = remote.tokenizer.encode("ab")
        groups = local.sample([prompt, prompt[:1]], 4, SamplingParams(max_tokens=6, seed=2))
        datums = [make_datum(p, c, (-1.0) ** j + 0.25 * i)
                  for i, (p, g) in enumerate(zip([prompt, prompt[:1]], groups, strict=True))
                  for j, c in enumerate(g)]
        for loss in (LossConfig(name="ppo", clip_eps=0.1), LossConfig()):
            want = local.forward_backward(datums, loss)
            got = remote.forward_backward(datums, loss)
            assert got.loss == pytest.approx(want.loss, rel=1e-4, abs=1e-6)
            for d, a, b in zip(datums, want.logprobs, got.logprobs, strict=True):
                masked = [(x, y) for x, y, m in zip(a, b, d.mask, strict=True) if m]
                np.testing.assert_allclose(*zip(*masked, strict=True), atol=1e-5)
            adam = AdamParams(learning_rate=0.05, grad_clip_norm=1.0)
            want_opt = local.optim_step(adam)
            got_opt = remote.optim_step(adam)
            assert got_opt.grad_norm == pytest.approx(want_opt.grad_norm, rel=1e-4)
        backend_id = next(iter(engine._backends.values()))
        # Two Adam steps of lr 0.05 move weights by ~0.1; summation order (advantages scaled
        # by 1/N remotely vs a loss divided by N locally) leaves float noise of a few 1e-6.
        for (_, a), (_, b) in zip(local.params.items(), backend_id.params.items(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)
        remote.close()


def test_two_workers_share_the_campaign_semaphore(tmp_path, sdk_env, tiny_model):
    """Two backends (as two campaign workers) on the real cross-process semaphore with 2
    slots: both finish (no deadlock) and the server never has more than 2 requests."""
    from retrain.slots.file_slots import CountingSemaphore

    with Served(_engine(tiny_model, delay_s=0.02), tmp_path, hold_s=2.0) as served:
        backends = [_backend(served.url, slots=CountingSemaphore(tmp_path / "slots", 2))
                    for _ in range(2)]
        served.traffic.reset_peak()
        errors = []

        def work(b):
            try:
                for _ in range(3):
                    comps = b.sample([[1, 70]] * 4, 2, SamplingParams(max_tokens=3))
                    b.forward_backward([make_datum([1, 70], c, 1.0) for g in comps for c in g],
                                       LossConfig())
                    b.optim_step(AdamParams(learning_rate=0.1))
                    b.save_state("s")
            except Exception as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(b,)) for b in backends]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
        assert not errors and not any(t.is_alive() for t in threads)
        assert served.traffic.peak <= 2
        assert sum(b.slots.wait_s for b in backends) > 0  # they did queue for slots
        for b in backends:
            b.close()


def test_superseded_checkpoints_are_deleted_on_the_service(tmp_path, sdk_env, tiny_model):
    """Like the trainer's own pruning: keep every save_every-th, the final, the newest two."""
    with Served(_engine(tiny_model), tmp_path, hold_s=2.0) as served:
        backend = TinkerBackend(base_model="bigram-test", lora_rank=2, seed=0,
                                base_url=served.url, request_timeout_s=30, keep_every=3,
                                final_step=7)
        paths = [backend.save_state(f"step-{i:06d}") for i in range(1, 8)]
        backend.close()
        run_dir = served.service.state_dir / "runs" / paths[0].split("/")[2] / "weights"
        assert sorted(p.name for p in run_dir.iterdir()) == \
            ["step-000003", "step-000006", "step-000007"]


def test_rate_limited_client_queues_outside_its_slot(tmp_path, sdk_env, tiny_model):
    """serve holds 1 training client (--max-sessions 1): a second backend gets 429, waits
    with its slot given back (the only slot: the first backend keeps training meanwhile),
    and gets its client once the first one finishes; nothing fails."""
    slots = CountingSlots(1)
    with Served(_engine(tiny_model), tmp_path, hold_s=2.0, max_sessions=1) as served:
        a = _backend(served.url, slots=slots)
        assert a.training.model_id
        b = _backend(served.url, slots=slots)
        got: dict = {}

        def second():
            try:
                got["model_id"] = b.training.model_id
            except BaseException as exc:  # reported below
                got["error"] = exc

        waiter = threading.Thread(target=second, daemon=True)
        waiter.start()
        deadline = time.monotonic() + 60
        while b.rate_limit_wait_s == 0 and time.monotonic() < deadline and waiter.is_alive():
            time.sleep(0.1)
        assert b.rate_limit_wait_s > 0, got  # the SDK gave up once; the backend queued it
        _step(a, [1, 70, 71])                # one slot, yet `a` is not starved
        assert waiter.is_alive() and not got  # b still queued, not failed
        a.close()                             # frees the server's place
        waiter.join(90)
        assert "model_id" in got, got
        _step(b, [1, 70, 71])
        assert slots.peak <= 1
        b.close()


def test_no_slot_is_held_while_a_rate_limited_client_sleeps(tmp_path, sdk_env, tiny_model):
    """Under a saturated serve (--max-sessions 1, taken), a second backend's request for a
    training client is answered 429 with `x-should-retry: false`, the SDK does not retry it
    inside the slot, and the backend's own backoff sleeps with the slot given back: sampled
    every 20 ms for 6 s, the slot is held only for the moments its requests are in flight."""
    slots = CountingSlots(1)
    with Served(_engine(tiny_model), tmp_path, hold_s=2.0, max_sessions=1) as served:
        a = _backend(served.url)
        assert a.training.model_id
        h = {"X-API-Key": KEY}
        sess = httpx.post(f"{served.url}/api/v1/create_session", headers=h, json={
            "tags": [], "user_metadata": {}, "sdk_version": "x"}).json()["session_id"]
        body = {"session_id": sess, "model_seq_id": 0, "base_model": "bigram-test"}
        r = httpx.post(f"{served.url}/api/v1/create_model", headers=h, json=body)
        assert r.status_code == 429 and "x-should-retry" not in r.headers  # SDK retries it
        r = httpx.post(f"{served.url}/api/v1/create_model", json=body,
                       headers={**h, QUEUES_429_HEADER: "1"})  # what the backend sends
        assert r.status_code == 429 and r.headers["x-should-retry"] == "false"
        b = _backend(served.url, slots=slots)
        waiter = threading.Thread(target=lambda: b.training, daemon=True)
        waiter.start()
        held = []
        for _ in range(300):
            time.sleep(0.02)
            held.append(slots.held)
        assert waiter.is_alive() and b.rate_limit_wait_s > 0
        assert sum(held) / len(held) < 0.25, sum(held) / len(held)
        a.close()
        waiter.join(90)
        assert b._training is not None
        b.close()


def test_stop_strings_go_to_the_service_and_cut_where_the_local_sampler_would(
        tmp_path, sdk_env, tiny_model):
    """training.stop over `retrain serve`: the strings travel as SamplingParams.stop, each
    completion is the unstopped one cut at its first stop string, EOS still ends rows."""
    from retrain.backends.local.model import LocalModel
    from retrain.backends.stop_strings import cut_at_stop_strings
    from retrain.serve.local_engine import LocalEngine

    engine = LocalEngine(LocalModel.load(tiny_model, "float32", "cpu", 1), "tiny-random")
    with Served(engine, tmp_path, hold_s=2.0) as served:
        remote = TinkerBackend(base_model="tiny-random", lora_rank=4, seed=11,
                               base_url=served.url, request_timeout_s=30)
        prompts = [remote.tokenizer.encode("ab"), remote.tokenizer.encode("x")]
        free = remote.sample(prompts, 4, SamplingParams(max_tokens=12, seed=2))
        decode = remote.tokenizer.decode
        longest = max((c.tokens for g in free for c in g), key=len)
        stop = next(decode(longest[i:i + 1]) for i in range(3, len(longest))
                    if decode(longest[i:i + 1]).isprintable())
        stopped = remote.sample(prompts, 4, SamplingParams(max_tokens=12, seed=2,
                                                           stop_strings=(stop,)))
        remote.close()
    cut = 0
    for g_free, g_stop in zip(free, stopped, strict=True):
        for a, b in zip(g_free, g_stop, strict=True):
            want = cut_at_stop_strings(a, [stop], decode)
            assert (b.tokens, b.finish_reason) == (want.tokens, want.finish_reason)
            np.testing.assert_allclose(b.logprobs, want.logprobs, atol=1e-5)
            cut += len(b.tokens) < len(a.tokens)
    assert cut >= 1


def test_prompt_seeds_go_to_the_service_so_a_split_samples_alike(tmp_path, sdk_env,
                                                                  tiny_model):
    """The trainer keys each group's draws by its number in the step (rollout.keyed): the
    service gets each prompt's own seed, not the call's seed plus its place in the call."""
    from retrain.environments.rollout import keyed

    with Served(_engine(tiny_model), tmp_path, hold_s=2.0) as served:
        backend = _backend(served.url)
        try:
            ps = [backend.tokenizer.encode(t) for t in ("ab", "cd", "ef")]
            params = SamplingParams(max_tokens=8, seed=4)
            whole = backend.sample(ps, 3, keyed(params, range(3)))
            split = (backend.sample(ps[:1], 3, keyed(params, [0]))
                     + backend.sample(ps[1:], 3, keyed(params, [1, 2])))
        finally:
            backend.close()
    assert [[c.tokens for c in g] for g in split] == [[c.tokens for c in g] for g in whole]

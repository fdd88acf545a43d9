"""A refused request does not wedge its training client: on the real local engine (tiny
model) through the unmodified tinker SDK, a client whose forward_backward, forward, sample
or optim_step is answered 400 (or 413) sends a valid request next, then an optimizer step,
and both complete. The server completes the refused request's place in the model's order."""

from __future__ import annotations

import math

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.serve_doubles import KEY, BigramEngine, Served  # noqa: E402

WAIT_S = 60  # a wedged client never completes; a healthy one takes a second or two


@pytest.fixture
def client(tmp_path, sdk_env, tiny_engine):
    """A LoRA client of a server that takes bodies up to 20 kB, and gives up a seq_id it
    never received after 1 s (the 413 case: a body refused unread names no seq_id)."""
    with Served(tiny_engine, tmp_path, hold_s=2.0, max_body_bytes=20_000,
                order_gap_s=1.0) as served:
        service = tinker.ServiceClient(base_url=served.url)
        tc = service.create_lora_training_client(base_model="tiny-random", rank=4,
                                                 seed=1).result()
        tc.served = served
        yield tc
        service.close("success").result()


def _datum(advantage: float = 1.0, n: int = 6) -> types.Datum:
    tokens = list(range(10, 10 + n + 1))
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:],
                                       "logprobs": [-2.0] * n, "advantages": [advantage] * n})


def _refuse_forward_backward(tc):
    tc.forward_backward([_datum(math.nan)], "importance_sampling").result(WAIT_S)


def _refuse_forward(tc):  # a loss the SDK knows and retrain serve does not (no formula)
    tc.forward([_datum()], "stable_reinforce").result(WAIT_S)


def _refuse_optim_step(tc):
    tc.optim_step(types.AdamParams(learning_rate=0.01, beta1=1.0)).result(WAIT_S)


def _refuse_too_large(tc):  # one chunk for the SDK, over the server's 20 kB
    tc.forward_backward([_datum(n=40)] * 40, "importance_sampling").result(WAIT_S)


def _refuse_sample(tc):
    sc = tc.save_weights_and_get_sampling_client().result(WAIT_S)
    sc.sample(types.ModelInput.from_ints([5, 6]), 1,
              types.SamplingParams(max_tokens=2, top_k=5)).result(WAIT_S)


@pytest.mark.parametrize("refuse,status", [
    (_refuse_forward_backward, "advantages"),
    (_refuse_forward, "stable_reinforce"),
    (_refuse_optim_step, "beta1"),
    (_refuse_too_large, "20000 bytes"),
    (_refuse_sample, "top_k"),
], ids=["forward_backward", "forward", "optim_step", "413", "sample"])
def test_a_refused_request_leaves_the_client_training(client, refuse, status):
    with pytest.raises(tinker.APIStatusError, match=status) as refused:
        refuse(client)
    assert refused.value.status_code in (400, 413)
    fwd = client.forward([_datum()], "importance_sampling").result(WAIT_S)
    out = client.forward_backward([_datum()], "importance_sampling").result(WAIT_S)
    assert out.metrics["loss:sum"] == pytest.approx(fwd.metrics["loss:sum"], rel=1e-4)
    step = client.optim_step(types.AdamParams(learning_rate=0.01)).result(WAIT_S)
    assert step.metrics["skipped"] == 0.0 and step.metrics["grad_norm"] > 0
    sc = client.save_weights_and_get_sampling_client().result(WAIT_S)
    res = sc.sample(types.ModelInput.from_ints([5, 6]), 2,
                    types.SamplingParams(max_tokens=3)).result(WAIT_S)
    assert len(res.sequences) == 2 and all(1 <= len(s.tokens) <= 3 for s in res.sequences)


def test_a_body_that_does_not_validate_completes_its_place(tmp_path):
    """An optim_step whose JSON does not validate is a 400, and the seq_id it names is done:
    the next op (seq_id 2) runs instead of waiting for seq_id 1."""
    h = {"X-API-Key": KEY}
    with Served(BigramEngine(), tmp_path, hold_s=2.0) as served:
        api = f"{served.url}/api/v1"
        session = httpx.post(f"{api}/create_session", headers=h, json={
            "tags": [], "user_metadata": {}, "sdk_version": "x"}).json()["session_id"]
        fut = httpx.post(f"{api}/create_model", headers=h, json={
            "session_id": session, "model_seq_id": 0, "base_model": "bigram-test"}).json()
        httpx.post(f"{api}/retrieve_future", headers=h, json={"request_id": fut["request_id"]})
        bad = httpx.post(f"{api}/optim_step", headers=h, json={
            "model_id": fut["model_id"], "seq_id": 1, "adam_params": {"learning_rate": "x"}})
        assert bad.status_code == 400 and "learning_rate" in bad.json()["error"]
        step = httpx.post(f"{api}/optim_step", headers=h, json={
            "model_id": fut["model_id"], "seq_id": 2, "adam_params": {"learning_rate": 0.1}})
        done = httpx.post(f"{api}/retrieve_future", headers=h, timeout=10,
                          json={"request_id": step.json()["request_id"]}).json()
        assert done["type"] == "optim_step" and "grad_norm:mean" in done["metrics"], done


def test_sequencer_skips_refused_places_and_gives_up_holes():
    import asyncio

    from retrain.serve.tinker.ordering import Sequencer

    async def main():
        seq, order = Sequencer(gap_s=0.3), []

        def job(n):
            async def run():
                order.append(n)
            return run

        seq.submit(2, "b", job(2))
        seq.skip(1)                      # seq 1 was refused: seq 2 runs at once
        await asyncio.sleep(0.05)
        assert order == [2] and seq.next_seq == 3
        seq.skip(2)                      # a place already run: nothing changes
        assert seq.next_seq == 3
        seq.submit(5, "e", job(5))       # 3 and 4 never come (refused unread)
        await asyncio.sleep(0.1)
        assert order == [2] and not seq.idle
        idle = asyncio.Event()
        seq.when_idle(idle.set)
        await asyncio.wait_for(idle.wait(), 5)
        assert order == [2, 5] and seq.next_seq == 6
        with pytest.raises(ValueError):
            seq.submit(4, "late", job(4))

    asyncio.run(main())


@pytest.mark.parametrize("rank", [0, -3, 65_537])
def test_a_lora_rank_out_of_range_is_400_naming_the_field(tmp_path, sdk_env, tiny_engine,
                                                          rank):
    with Served(tiny_engine, tmp_path, hold_s=2.0) as served:
        service = tinker.ServiceClient(base_url=served.url)
        with pytest.raises(tinker.BadRequestError, match=r"lora_config.rank must be between "
                                                         r"1 and 65536, got -?\d+"):
            service.create_lora_training_client(base_model="tiny-random",
                                                rank=rank).result(WAIT_S)
        assert served.service.live_sessions() == 0   # the refused client took no place
        tc = service.create_lora_training_client(base_model="tiny-random",
                                                 rank=2).result(WAIT_S)
        assert tc.get_info().lora_rank == 2
        service.close("success").result()

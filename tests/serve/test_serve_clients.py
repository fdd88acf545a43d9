"""What real Tinker clients send, on the real local engine (tiny model) through the SDK:
stop strings, `cross_entropy` (supervised), forward-only passes, prompt log-probs."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from retrain.backends.base import Completion  # noqa: E402
from retrain.backends.stop_strings import cut_at_stop_strings, first_stop_end  # noqa: E402
from tests.serve_doubles import Served  # noqa: E402


@pytest.fixture
def client(tmp_path, sdk_env, tiny_engine):
    with Served(tiny_engine, tmp_path, hold_s=2.0) as served:
        service = tinker.ServiceClient(base_url=served.url)
        tc = service.create_lora_training_client(base_model="tiny-random", rank=4,
                                                 seed=2).result()
        yield tc
        service.close("success").result()


def test_first_stop_end_is_the_token_that_completes_the_stop():
    pieces = ["a", "b", "\n", "\nUs", "er:", "x"]
    decode = lambda toks: "".join(pieces[t] for t in toks)  # noqa: E731
    assert first_stop_end(range(6), ["\n\nUser:"], decode) == 5
    assert first_stop_end(range(6), ["b"], decode) == 2
    assert first_stop_end(range(6), ["zz"], decode) is None
    assert first_stop_end(range(6), ["zz", "ab"], decode) == 2   # the earliest of several
    c = cut_at_stop_strings(Completion(list(range(6)), [-1.0] * 6, "length"), ["er:"], decode)
    assert c.tokens == [0, 1, 2, 3, 4] and c.logprobs == [-1.0] * 5 and c.finish_reason == "stop"


def test_stop_strings_cut_on_decoded_text(client):
    tok = client.get_tokenizer()
    sc = client.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tok.encode("hello there"))
    free = sc.sample(prompt, 1, types.SamplingParams(max_tokens=16, temperature=0.0,
                                                     stop=[2])).result().sequences[0]
    tokens = list(free.tokens)
    assert len(tokens) >= 8, "greedy text too short to pick a stop string from"
    stop = tok.decode(tokens[3:6])   # text that first appears by token 6 at the latest
    res = sc.sample(prompt, 1, types.SamplingParams(max_tokens=16, temperature=0.0,
                                                    stop=stop)).result().sequences[0]
    end = len(res.tokens)
    assert res.stop_reason == "stop" and res.tokens == tokens[:end] and end <= 6
    assert stop in tok.decode(res.tokens) and stop not in tok.decode(res.tokens[:-1])
    np.testing.assert_allclose(res.logprobs, free.logprobs[:end], atol=1e-5)
    both = sc.sample(prompt, 1, types.SamplingParams(max_tokens=16, temperature=0.0,
                                                     stop=[stop, "never-there"])).result()
    assert both.sequences[0].tokens == res.tokens


def _sft_datum(tokens, weights):
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


def test_cross_entropy_trains_and_forward_only_does_not(client):
    tok = client.get_tokenizer()
    tokens = tok.encode("the cat sat on the mat")
    n = len(tokens) - 1
    weights = [0.0] * 2 + [1.0] * (n - 2)          # the first two targets are "prompt"
    datum = _sft_datum(tokens, weights)
    fwd = client.forward([datum], "cross_entropy").result()
    lp = np.asarray(fwd.loss_fn_outputs[0]["logprobs"].data)
    assert lp.shape == (n,) and np.all(lp < 0)
    assert fwd.metrics["loss:sum"] == pytest.approx(-float(np.dot(weights, lp)), rel=1e-5)
    # a forward pass leaves no gradient behind: the next step has nothing to apply
    step = client.optim_step(types.AdamParams(learning_rate=0.05)).result()
    assert step.metrics["skipped"] == 1.0
    losses = []
    for _ in range(4):
        out = client.forward_backward([datum], "cross_entropy").result()
        losses.append(out.metrics["loss:sum"])
        client.optim_step(types.AdamParams(learning_rate=0.05)).result()
    assert losses[0] == pytest.approx(fwd.metrics["loss:sum"], rel=1e-4)
    assert losses[-1] < losses[0] * 0.9   # supervised fine-tuning learns the sequence


def test_compute_logprobs_matches_the_trainer(client):
    tok = client.get_tokenizer()
    tokens = tok.encode("one two three four")
    sc = client.save_weights_and_get_sampling_client().result()
    got = sc.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert got[0] is None and len(got) == len(tokens)
    fwd = client.forward([_sft_datum(tokens, [1.0] * (len(tokens) - 1))],
                         "cross_entropy").result()
    want = np.asarray(fwd.loss_fn_outputs[0]["logprobs"].data)
    np.testing.assert_allclose(got[1:], want, atol=1e-4)


def test_forward_backward_custom_runs_over_forward_and_cross_entropy(client):
    """The SDK's custom loss: a forward pass, torch on the client, a cross_entropy surrogate."""
    torch = pytest.importorskip("torch")
    tok = client.get_tokenizer()
    tokens = tok.encode("a custom loss")
    datum = _sft_datum(tokens, [1.0] * (len(tokens) - 1))

    def loss_fn(data, logprobs_list):
        loss = -torch.stack([lp.sum() for lp in logprobs_list]).sum()
        return loss, {"custom": float(loss)}

    out = client.forward_backward_custom([datum], loss_fn).result()
    ce = client.forward([datum], "cross_entropy").result()
    assert out.metrics["custom"] == pytest.approx(ce.metrics["loss:sum"], rel=1e-4)
    step = client.optim_step(types.AdamParams(learning_rate=0.05)).result()
    assert step.metrics["skipped"] == 0.0 and step.metrics["grad_norm"] > 0


def test_training_run_metadata_for_resume(tmp_path, sdk_env):
    """tinker-cookbook reads its renderer back from the run's user_metadata on resume."""
    from tests.serve_doubles import BigramEngine

    with Served(BigramEngine(), tmp_path, hold_s=2.0) as served:
        service = tinker.ServiceClient(base_url=served.url)
        tc = service.create_lora_training_client(
            base_model="bigram-test", rank=3, user_metadata={"renderer_name": "role_colon"}
        ).result()
        path = tc.save_state("c1").result().path
        rest = tinker.RestClient(base_url=served.url)
        run = rest.get_training_run_by_tinker_path(path).result()
        assert run.user_metadata == {"renderer_name": "role_colon"} and run.lora_rank == 3
        service.close("success").result()
        # the model is gone; the checkpoint still tells
        run = tinker.RestClient(base_url=served.url).get_training_run_by_tinker_path(
            path).result()
        assert run.user_metadata == {"renderer_name": "role_colon"}
        with pytest.raises(tinker.NotFoundError):
            rest.get_training_run_by_tinker_path("tinker://nope/weights/x").result()

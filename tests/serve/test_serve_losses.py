"""`retrain serve` answers every LossFnType of the pinned SDK, asked by the real tinker SDK on
the tiny model: each built-in loss trains and returns the documented sum; stable_reinforce and
`custom` get a 400 that says what is supported; an uploaded loss graph is never run."""

from __future__ import annotations

import math

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
torch = pytest.importorskip("torch")
from tinker import types  # noqa: E402

from retrain.algorithms.losses import TINKER_LOSS_FN_TYPES, UNSUPPORTED  # noqa: E402
from tests.serve_doubles import KEY, Served  # noqa: E402

BUILT_IN = {
    "cross_entropy": None,
    "importance_sampling": None,
    "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "cispo": None,                                       # Tinker's default: [0, 4]
    "dro": {"beta": 0.3},
    "gspo": {"clip_low_threshold": 0.97, "clip_high_threshold": 1.02},
}
PROMPT = 2   # targets that belong to the prompt: logprob 0, advantage 0, outside the ratio


@pytest.fixture
def served(tmp_path, sdk_env, tiny_engine):
    with Served(tiny_engine, tmp_path, hold_s=2.0) as served:
        service = tinker.ServiceClient(base_url=served.url)
        yield served, service
        service.close("success").result()


def _client(service, seed=3):
    return service.create_lora_training_client(base_model="tiny-random", rank=4,
                                               seed=seed).result()


def _inputs(tc, loss: str) -> tuple[list[int], dict]:
    """An RL datum a step off-policy: the sampler's log-probs are the trainer's, shifted."""
    tokens = tc.get_tokenizer().encode("the cat sat on the mat and the dog")
    n = len(tokens) - 1
    ce = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                     loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n})
    now = np.asarray(tc.forward([ce], "cross_entropy").result()
                     .loss_fn_outputs[0]["logprobs"].data, dtype=np.float64)
    rng = np.random.default_rng(7)
    mask = np.r_[np.zeros(PROMPT), np.ones(n - PROMPT)]
    old = (now - rng.uniform(-0.4, 0.4, n)) * mask
    adv = rng.choice([-1.0, 1.0], n) * rng.uniform(0.5, 1.5, n) * mask
    if loss == "cross_entropy":
        return tokens, {"target_tokens": tokens[1:], "weights": mask.astype(np.float32)}
    inputs = {"target_tokens": tokens[1:], "logprobs": old.astype(np.float32),
              "advantages": adv.astype(np.float32)}
    if loss == "gspo":
        inputs["sequence_ratio_mask"] = mask.astype(np.float32)
    return tokens, inputs


def _documented_sum(loss: str, lp, inputs: dict, config: dict | None) -> float:
    """The Tinker page's formula, summed over every position, as a plain loop."""
    config = config or {}
    if loss == "cross_entropy":
        return -sum(w * p for w, p in zip(inputs["weights"], lp, strict=True))
    old, adv = inputs["logprobs"].astype(float), inputs["advantages"].astype(float)
    lo = config.get("clip_low_threshold", 0.0 if loss == "cispo" else 0.8)
    hi = config.get("clip_high_threshold", 4.0 if loss == "cispo" else 1.2)
    if loss == "gspo":
        marked = [p - q for p, q, m in zip(lp, old, inputs["sequence_ratio_mask"], strict=True)
                  if m]
        s = math.exp(sum(marked) / len(marked))
    total = 0.0
    for p, q, a in zip(lp, old, adv, strict=True):
        r = s if loss == "gspo" else math.exp(p - q)
        clip = min(max(r, lo), hi)
        total -= {"importance_sampling": r * a, "ppo": min(r * a, clip * a),
                  "gspo": min(r * a, clip * a), "cispo": clip * p * a,
                  "dro": p * a - 0.5 * config.get("beta", 0.05) * (p - q) ** 2}[loss]
    return total


def test_every_loss_fn_type_is_answered():
    assert set(BUILT_IN) | set(UNSUPPORTED) == set(TINKER_LOSS_FN_TYPES)


@pytest.mark.parametrize("loss", list(BUILT_IN))
def test_each_built_in_loss_trains_and_returns_the_documented_sum(served, loss):
    _, service = served
    tc = _client(service)
    tokens, inputs = _inputs(tc, loss)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs=inputs)
    fwd = tc.forward([datum], loss, BUILT_IN[loss]).result()
    out = tc.forward_backward([datum], loss, BUILT_IN[loss]).result()
    lp = np.asarray(out.loss_fn_outputs[0]["logprobs"].data, dtype=np.float64)
    want = _documented_sum(loss, lp, inputs, BUILT_IN[loss])
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert fwd.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-5)
    step = tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    assert step.metrics["skipped"] == 0.0 and step.metrics["grad_norm"] > 0
    after = tc.forward([datum], loss, BUILT_IN[loss]).result()
    moved = np.asarray(after.loss_fn_outputs[0]["logprobs"].data) - lp
    assert np.abs(moved).max() > 1e-3            # the update was applied to the weights


@pytest.mark.parametrize("loss, config, words", [
    ("stable_reinforce", None, "not published"),
    ("custom", {"loss_id": "loss-1"}, "it computes cross_entropy, importance_sampling"),
    ("ppo", {"beta": 0.1}, "'beta' are not read by loss 'ppo'"),
    ("cispo", {"clip_low_threshold": 2.0, "clip_high_threshold": 1.0}, "clip_low_threshold <="),
])
def test_unsupported_losses_and_configs_get_a_400_saying_what_is_supported(served, loss,
                                                                          config, words):
    _, service = served
    tc = _client(service)
    tokens, inputs = _inputs(tc, "importance_sampling")
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs=inputs)
    with pytest.raises(tinker.BadRequestError, match=words):
        tc.forward_backward([datum], loss, config).result()


def hostile_graph(marker) -> dict:
    """A traced-loss graph (the SDK's CustomLossGraph form) whose nodes would write `marker`."""
    return {"format": 1, "nodes": [
        {"op": "placeholder", "name": "logprobs", "target": "logprobs"},
        {"op": "call_function", "name": "boom", "target": "os.system",
         "args": [f"touch {marker}"]},
        {"op": "call_function", "name": "ev", "target": "builtins.eval",
         "args": [f"open({str(marker)!r}, 'w')"]},
        {"op": "output", "name": "output", "target": "output",
         "args": [{"tuple": [{"ref": "logprobs"}, {"dict": {}}]}]},
    ]}


def test_an_uploaded_loss_graph_is_refused_unread_and_never_runs(served, tmp_path):
    srv, service = served
    marker = tmp_path / "pwned"
    headers = {"X-API-Key": KEY}
    session = httpx.post(f"{srv.url}/api/v1/create_session", headers=headers, json={
        "tags": [], "user_metadata": {}, "sdk_version": "x"}).json()["session_id"]
    reply = httpx.post(f"{srv.url}/api/v1/create_custom_loss", headers=headers, json={
        "session_id": session, "custom_loss_seq_id": 0, "name": "boom",
        "inputs": [{"name": "logprobs", "rank": 1}], "graph": hostile_graph(marker)})
    assert reply.status_code == 400 and "never executes" in reply.text
    assert "create_custom_loss and forward_backward_custom work" in reply.text
    assert not marker.exists()


def test_the_sdks_custom_loss_runs_on_the_client_and_trains(served):
    _, service = served
    tc = _client(service)

    def neg_logprob(logprobs, weights):
        loss = -(logprobs * weights).sum()
        return loss, {"custom/nll:sum": loss}

    handle = service.create_custom_loss(neg_logprob, {"logprobs": 1, "weights": 1}).result()
    assert handle.loss_id is None          # custom_loss_server_side is false: nothing uploaded
    tokens, inputs = _inputs(tc, "cross_entropy")
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs=inputs)
    out = tc.forward_backward_custom([datum], handle).result()
    ce = tc.forward([datum], "cross_entropy").result()
    assert out.metrics["loss:sum"] == pytest.approx(ce.metrics["loss:sum"], rel=1e-4)
    step = tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    assert step.metrics["skipped"] == 0.0 and step.metrics["grad_norm"] > 0

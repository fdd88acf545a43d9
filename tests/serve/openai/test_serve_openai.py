"""The OpenAI-compatible routes of `retrain serve`, driven by the official `openai` SDK against
a real `retrain serve` process on the tiny model: chat completions (plain and streamed),
completions with log-probs, n > 1, seeds, stop strings, a trained run served with `--adapter`
(the same greedy text as `retrain sample`), Tinker sampler weights listed and sampled, and
400s that name the field. Also the sampler's token hook and top log-probs underneath."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("torch")

from retrain.backends.base import SamplingParams  # noqa: E402
from retrain.cli.app import run_app  # noqa: E402
from retrain.errors import UserError  # noqa: E402
from retrain.serve.openai.reply import TextStream, Tokens  # noqa: E402
from tests import warm  # noqa: E402
from tests.run_helpers import read_serve_url, write_config  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
PROMPT = "What is 2 + 2?"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model):
    """A 2-step tiny run, every step's checkpoint kept."""
    folder = tmp_path_factory.mktemp("openai-run")
    path = write_config(folder, training={"max_steps": 2, "save_every": 1},
                        logging={"log_dir": str(folder / "logs")})
    assert run_app(["run", str(path)]) == 0
    return folder / "logs" / "run"


@pytest.fixture(scope="module")
def server(run_dir, tmp_path_factory, model_cache):
    """`retrain serve` as users start it, with the run's last and first steps as adapters."""
    state = tmp_path_factory.mktemp("openai-serve-state")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RETRAIN_CACHE": str(model_cache),
           "RETRAIN_SERVE_DIR": str(state), "PYTHONUNBUFFERED": "1"}
    proc = warm.Popen([sys.executable, "-m", "retrain", "serve", "--model", "tiny-random",
                       "--port", "0", "--dtype", "float32",
                       "--adapter", f"trained={run_dir}",
                       "--adapter", f"early={run_dir}@1"],
                      env=env, stderr=subprocess.PIPE, text=True)
    try:
        yield read_serve_url(proc, 120)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _chat(client, model="tiny-random", **kwargs):
    kwargs.setdefault("messages", [{"role": "user", "content": PROMPT}])
    return client.chat.completions.create(model=model, **kwargs)


# ---------------------------------------------------------------- chat, completions, streams


def test_chat_plain_and_streamed_give_the_same_text(client, tiny_model):
    from transformers import AutoTokenizer

    from retrain.results.sample import render

    plain = _chat(client, max_tokens=12, temperature=0)
    [choice] = plain.choices
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt = render(tokenizer, [{"role": "user", "content": PROMPT}], True)
    assert plain.usage.prompt_tokens == len(prompt)
    chunks = list(_chat(client, max_tokens=12, temperature=0, stream=True,
                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == choice.finish_reason and not any(finish[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert len({c.id for c in chunks}) == 1


def test_completion_logprobs_are_the_samplers(client, server, sdk_env):
    """Greedy token log-probs are those the Tinker route reports for the same prompt (the
    same engine), and each is the largest of its top alternatives."""
    tinker = pytest.importorskip("tinker")
    from tinker import types

    prompt = [5, 77, 104, 101, 108, 108, 111]
    got = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=8,
                                    temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and value == pytest.approx(max(top.values()), abs=1e-6)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    with tinker.ServiceClient(base_url=server) as service:
        sampler = service.create_sampling_client(base_model="tiny-random").result()
        want = sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(
            max_tokens=8, temperature=0.0)).result().sequences[0]
    assert lp.token_logprobs == pytest.approx(list(want.logprobs), abs=1e-4)
    assert got.usage.completion_tokens == len(want.tokens)


def test_echo_puts_the_prompt_and_its_logprobs_first(client):
    """`echo` (lm-eval's loglikelihood requests): the prompt's text and tokens before the
    choice's own, its log-probs None first, each a top alternative's when it is the top one."""
    prompt = [5, 77, 104, 101, 108]
    got = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=2,
                                    temperature=0, logprobs=1, echo=True)
    plain = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=2,
                                      temperature=0, logprobs=1)
    lp, own = got.choices[0].logprobs, plain.choices[0].logprobs
    assert got.choices[0].text.endswith(plain.choices[0].text)
    assert lp.tokens[5:] == own.tokens  # two requests: equal log-probs, not equal bits
    assert lp.token_logprobs[5:] == pytest.approx(own.token_logprobs, abs=1e-5)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:5])
    for value, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert len(top) == 1 and value <= max(top.values()) + 1e-5
    assert got.usage.completion_tokens == plain.usage.completion_tokens


def test_max_tokens_0_with_echo_scores_the_prompt_alone(client):
    """OpenAI's legacy way to score a text: `max_tokens: 0` with `echo` answers the prompt,
    its tokens and log-probs, and no completion. Without `echo` it stays a 400 that says so."""
    prompt = [5, 77, 104, 101, 108]
    got = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=0,
                                    temperature=0, logprobs=1, echo=True)
    one = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=1,
                                    temperature=0, logprobs=1, echo=True)
    c, lp, lp1 = got.choices[0], got.choices[0].logprobs, one.choices[0].logprobs
    assert c.finish_reason == "length" and one.choices[0].text.startswith(c.text)
    assert lp.tokens == lp1.tokens[:5] and lp.text_offset == lp1.text_offset[:5]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(lp1.token_logprobs[1:5], abs=1e-5)
    assert [len(t) for t in lp.top_logprobs[1:]] == [1, 1, 1, 1]
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (5, 0)
    plain = client.completions.create(model="tiny-random", prompt="hello", max_tokens=0,
                                      echo=True, n=2)
    assert [(ch.text, ch.logprobs) for ch in plain.choices] == [("hello", None)] * 2
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-random", prompt="hello", max_tokens=0)
    assert err.value.status_code == 400 and err.value.param == "max_tokens"
    assert "echo" in err.value.message


def test_n_choices_are_seeded_and_streamed_alike(client):
    def texts(**kw):
        out = client.completions.create(model="tiny-random", prompt=["hello", "abc"],
                                        max_tokens=8, temperature=1.0, n=3, **kw)
        assert [c.index for c in out.choices] == list(range(6))
        return [c.text for c in out.choices]

    first = texts(seed=5)
    assert texts(seed=5) == first
    assert texts(seed=6) != first
    streamed = [""] * 6
    finished = {}
    for chunk in client.completions.create(model="tiny-random", prompt=["hello", "abc"],
                                           max_tokens=8, temperature=1.0, n=3, seed=5,
                                           stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert streamed == first and sorted(finished) == list(range(6))


def _stop_in(text: str) -> tuple[str, int]:
    """A stop string first seen at position >= 1, without U+FFFD (the random model's text is
    mostly stray bytes): two characters where the text has them, else one."""
    for width in (2, 1):
        for k in range(1, len(text) - width + 1):
            s = text[k:k + width]
            if "\ufffd" not in s and text.find(s) == k:
                return s, k
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_end_the_text_before_them(client):
    free = client.completions.create(model="tiny-random", prompt="hello there", max_tokens=16,
                                     temperature=0).choices[0].text
    stop, k = _stop_in(free)
    got = client.completions.create(model="tiny-random", prompt="hello there", max_tokens=16,
                                    temperature=0, stop=[stop, "never-there"]).choices[0]
    assert got.text == free[:k] and got.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-random", prompt="hello there", max_tokens=16, temperature=0, stop=stop,
        stream=True))
    assert streamed == free[:k]


# ---------------------------------------------------------------- models: adapters and Tinker


def test_adapter_gives_retrain_samples_greedy_text(client, run_dir, capsys):
    for model, step in (("trained", "2"), ("early", "1")):
        assert run_app(["sample", str(run_dir), PROMPT, "--temperature", "0", "--step", step,
                        "--max-tokens", "8"]) == 0
        want = capsys.readouterr().out
        got = _chat(client, model, max_tokens=8, temperature=0)
        assert got.choices[0].message.content + "\n" == want and got.model == model
    base, trained = (_chat(client, m, max_tokens=1, temperature=0, logprobs=True)
                     for m in ("tiny-random", "trained"))
    first = [c.choices[0].logprobs.content[0] for c in (base, trained)]
    assert first[0].token != first[1].token or \
        abs(first[0].logprob - first[1].logprob) > 1e-4  # the adapter is applied


def test_models_lists_base_adapters_and_tinker_sampler_weights(client, server, sdk_env):
    tinker = pytest.importorskip("tinker")
    from tinker import types

    prompt = [5, 77, 104, 101, 108, 108, 111]
    with tinker.ServiceClient(base_url=server) as service:
        tc = service.create_lora_training_client(base_model="tiny-random", rank=4,
                                                 seed=2).result()
        path = tc.save_weights_for_sampler("openai-listed").result().path
        tc.save_weights_and_get_sampling_client().result()  # a live sampling session: listed
        cards = {m.id: m for m in client.models.list().data}
        want = service.create_sampling_client(model_path=path).result().sample(
            types.ModelInput.from_ints(prompt), 1,
            types.SamplingParams(max_tokens=6, temperature=0.0)).result().sequences[0]
    assert {"tiny-random", "trained", "early", path} <= set(cards)
    assert any(":sample:" in name for name in cards)
    assert cards["early"].model_extra["step"] == 1 and cards["trained"].parent == "tiny-random"
    assert client.models.retrieve("trained").id == "trained"
    got = client.completions.create(model=path, prompt=prompt, max_tokens=6, temperature=0,
                                    logprobs=0)
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(list(want.logprobs),
                                                                   abs=1e-4)


# ---------------------------------------------------------------- bad requests


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),            # past the model's context
    ({"seed": -1}, "seed"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),            # without logprobs
    ({"stop": [f"s{i}" for i in range(20)]}, "stop"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]},
     "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url":
                                                 {"url": "http://x"}}]}]},
     "messages[0].content"),
])
def test_bad_chat_requests_are_400s_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, **{"max_tokens": 4, **kwargs})
    assert err.value.status_code == 400 and err.value.param == param
    assert param.split("[")[0] in err.value.message


@pytest.mark.parametrize("kwargs, param", [
    ({"prompt": [[3, 999999]]}, "prompt"),           # a token id outside the vocabulary
    ({"prompt": ""}, "prompt"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "hi", "echo": True, "stream": True}, "echo"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
])
def test_bad_completion_requests_are_400s_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-random", max_tokens=4, **kwargs)
    assert err.value.status_code == 400 and err.value.param == param


def test_unknown_models_routes_and_bodies(client, server):
    import httpx

    with pytest.raises(openai.NotFoundError) as err:
        _chat(client, "nope", max_tokens=4)
    assert err.value.param == "model" and err.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    for body, param in ((b"{not json", None), (b'{"messages": []}', "model"),
                        (json.dumps({"model": "tiny-random"}).encode(), "messages")):
        reply = httpx.post(f"{server}/v1/chat/completions", content=body,
                           headers={"content-type": "application/json"})
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == param, error
    reply = httpx.post(f"{server}/v1/embeddings", json={"model": "tiny-random", "input": "x"})
    assert reply.status_code == 404 and "/v1/embeddings" in reply.json()["error"]["message"]


def test_body_cap_is_the_tinker_routes(server):
    """A body declared past the cap is refused before it is read, on /v1/ as on /api/v1/."""
    host, port = server.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\ncontent-length: 999999999\r\n\r\n")
        head = sock.recv(4096).decode()
    assert head.startswith("HTTP/1.1 413")


@pytest.mark.parametrize("extra, message", [
    (["--adapter", "bad"], "--adapter 'bad': give NAME=RUN_DIR[@STEP]"),
    (["--adapter", "x=/no/such/run"], "--adapter x=/no/such/run: /no/such/run: no such run "
                                      "folder"),
    (["--adapter", "x={run}@9"], "keeps no checkpoint of that step; kept steps: 1, 2"),
    (["--adapter", "x={run}", "--adapter", "x={run}@1"], "the name 'x' is given twice"),
    (["--adapter", "tiny-random={run}"], "'tiny-random' is the base model's name"),
    (["--adapter", "x={run}", "--model", "{copy}"], "the run trained 'tiny-random', but "
                                                    "this server serves"),
])
def test_bad_adapters_are_one_error_line(run_dir, tiny_model, tmp_path, capsys, extra, message):
    """Found before the model loads where only the folder matters; never a traceback."""
    import shutil

    copy = tmp_path / "other-model"  # the same weights in another folder: another model
    shutil.copytree(tiny_model, copy)
    args = ["serve", "--model", "tiny-random", "--port", "0", "--dtype", "float32",
            *(a.format(run=run_dir, copy=copy) for a in extra)]
    assert run_app(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1], err
    assert not [line for line in err if "Traceback" in line]


# ---------------------------------------------------------------- the key, in process


def test_api_key_as_a_bearer_token(tiny_engine, tmp_path):
    from retrain.serve.openai.routes import OpenAIServing
    from tests.serve_doubles import Served

    served_as = OpenAIServing(tiny_engine.model.tokenizer, frozenset(tiny_engine.model.eos_ids))
    with Served(tiny_engine, tmp_path, api_key="sk-right", openai=served_as) as served, \
            openai.OpenAI(base_url=f"{served.url}/v1", api_key="sk-right",
                          max_retries=0) as good, \
            openai.OpenAI(base_url=f"{served.url}/v1", api_key="sk-wrong", max_retries=0) as bad:
        assert [m.id for m in good.models.list().data] == ["tiny-random"]
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_both_apis_share_one_batch(tiny_engine, tmp_path, sdk_env):
    """A Tinker sample and an OpenAI completion with the same weights and settings wait for
    the model in one queue and are decoded together."""
    tinker = pytest.importorskip("tinker")
    from concurrent.futures import ThreadPoolExecutor

    from tinker import types

    from retrain.serve.openai.routes import OpenAIServing
    from tests.run_helpers import wait_until
    from tests.serve_doubles import Served

    served_as = OpenAIServing(tiny_engine.model.tokenizer, frozenset(tiny_engine.model.eos_ids))
    prompt = [5, 77, 104, 101]
    with Served(tiny_engine, tmp_path, openai=served_as) as served, \
            ThreadPoolExecutor(1) as pool, tinker.ServiceClient(base_url=served.url) as service, \
            openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0) as oa:
        sampler = service.create_sampling_client(base_model="tiny-random").result()
        with tiny_engine.model.lock:  # the model is busy: both requests queue up
            mine = pool.submit(oa.completions.create, model="tiny-random", prompt=prompt,
                               max_tokens=4, temperature=0, logprobs=0)
            theirs = sampler.sample(types.ModelInput.from_ints(prompt), 1,
                                    types.SamplingParams(max_tokens=4, temperature=0.0))
            # one batch key, two requests under it
            wait_until(lambda: [len(q) for q in list(tiny_engine._queued.values())] == [2], 60,
                       "both requests in one queue")
        got, want = mine.result(timeout=60), theirs.result(timeout=60).sequences[0]
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(list(want.logprobs),
                                                                   abs=1e-5)


def test_adapter_of_a_run_trained_through_this_server(tiny_engine, run_dir, tmp_path, sdk_env):
    """A tinker run against retrain serve names tinker:// checkpoints, which are this
    server's own folders: `--adapter` serves them (the run folder as the trainer leaves it:
    its config, a resume point per step naming the checkpoint)."""
    import shutil

    tinker = pytest.importorskip("tinker")
    from tinker import types

    from retrain.serve.checkpoints import CheckpointStore
    from retrain.serve.openai.adapters import AdapterSpec, find_runs, load_adapters
    from tests.serve_doubles import Served

    with Served(tiny_engine, tmp_path) as served, \
            tinker.ServiceClient(base_url=served.url) as service:
        tc = service.create_lora_training_client(base_model="tiny-random", rank=4,
                                                 seed=7).result()
        path = tc.save_state("step-000003").result().path
        prompt = types.ModelInput.from_ints([5, 77, 104])
        want = service.create_sampling_client(model_path=path).result().sample(
            prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0)).result()
        run = tmp_path / "tinker-run"
        (run / "checkpoints").mkdir(parents=True)
        shutil.copy(run_dir / "config.toml", run / "config.toml")
        (run / "checkpoints" / "step-000003.json").write_text(json.dumps({"checkpoint": path}))
        (run / "state.json").write_text(json.dumps({"step": 3, "checkpoint": path}))
        store = CheckpointStore(tmp_path / "serve-state", "tiny-random")
        [adapter] = load_adapters(tiny_engine, store,
                                  find_runs([AdapterSpec("t", run, None)])).values()
        got = tiny_engine.sample(adapter.snap, [5, 77, 104], 1,
                                 SamplingParams(max_tokens=6, temperature=0.0), False)
        tiny_engine.drop_snapshot(adapter.snap)
    assert adapter.step == 3 and got.sequences[0].tokens == list(want.sequences[0].tokens)
    elsewhere = CheckpointStore(tmp_path / "another-server", "tiny-random")
    with pytest.raises(UserError, match="not on this server"):
        load_adapters(tiny_engine, elsewhere, find_runs([AdapterSpec("t", run, None)]))


# ---------------------------------------------------------------- underneath: sampler, stream


def test_sampler_reports_each_token_and_its_top_alternatives(tiny_engine):
    heard: dict[int, list[int]] = {0: [], 1: []}
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=1, top_logprobs=3)
    result = tiny_engine.sample(None, [5, 6, 7], 2, params, False,
                                on_token=lambda i, t, lp, top: heard[i].append(t))
    plain = tiny_engine.sample(None, [5, 6, 7], 2, SamplingParams(max_tokens=6,
                                                                  temperature=0.8, seed=1),
                               False)
    for i, (c, p) in enumerate(zip(result.sequences, plain.sequences, strict=True)):
        assert heard[i] == c.tokens == p.tokens
        assert c.logprobs == pytest.approx(p.logprobs, abs=1e-5)
        assert p.top_logprobs is None and len(c.top_logprobs) == len(c.tokens)
        for lp, top in zip(c.logprobs, c.top_logprobs, strict=True):
            values = [v for _, v in top]
            assert len(top) == 3 and values == sorted(values, reverse=True)
            assert lp <= values[0] + 1e-6
    broken = tiny_engine.sample(None, [5, 6, 7], 2, params, False,
                                on_token=lambda *heard: 1 / 0)  # a listener that fails
    assert [c.tokens for c in broken.sequences] == [c.tokens for c in plain.sequences]


def test_text_stream_never_sends_a_stop_string_or_what_may_begin_one():
    pieces = ["a", "b", "<", "/", "s", ">", "x"]
    tok = Tokens(decode=lambda ids: "".join(pieces[i] for i in ids), piece=lambda i: pieces[i],
                 end_ids=frozenset({99}))
    stream = TextStream(tok, ("</s>",))
    assert [stream.push(t) for t in range(7)] == ["a", "b", "", "", "", "", ""]
    assert stream.finish("ab") == "" and stream.sent == "ab"
    loose = TextStream(tok, ("</s>",))
    assert [loose.push(t) for t in (0, 2, 1, 99)] == ["a", "", "<b", ""]
    assert loose.finish("a<b") == ""

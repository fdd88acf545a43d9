"""What `retrain serve`'s OpenAI routes refuse, as the official `openai` SDK sees it: a field of
the wrong JSON type is a 400 naming the field (never coerced: "3" is no `n`), a wrong key a 401
and a body over the cap a 413, both in OpenAI's error shape. And `--adapter` on a run whose
newest checkpoint cannot be served (its adapter_config.json gone, its weights truncated): the
newest readable one is served, and the server says which and why."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("torch")

from retrain.cli.app import run_app  # noqa: E402
from retrain.errors import UserError  # noqa: E402
from retrain.serve.checkpoints import CheckpointStore  # noqa: E402
from retrain.serve.openai.adapters import AdapterSpec, find_runs, load_adapters  # noqa: E402
from retrain.serve.openai.routes import OpenAIServing  # noqa: E402
from tests import warm  # noqa: E402
from tests.conftest import subprocess_env  # noqa: E402
from tests.run_helpers import write_config  # noqa: E402
from tests.serve_doubles import Served  # noqa: E402

CHAT = {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2}
COMPLETION = {"model": "tiny-random", "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def served(tiny_engine, tmp_path_factory):
    serving = OpenAIServing(tiny_engine.model.tokenizer, frozenset(tiny_engine.model.eos_ids))
    with Served(tiny_engine, tmp_path_factory.mktemp("refusals"), api_key="sk-right",
                openai=serving, max_body_bytes=4096) as server:
        yield server


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="sk-right", max_retries=0) as c:
        yield c


@pytest.mark.parametrize("route, body, field", [
    ("chat", {"n": "3"}, "n"),
    ("chat", {"n": True}, "n"),
    ("chat", {"logprobs": "yes"}, "logprobs"),
    ("chat", {"stream": "yes"}, "stream"),
    ("chat", {"max_tokens": "2"}, "max_tokens"),
    ("chat", {"seed": 1.5}, "seed"),
    ("completion", {"n": "3"}, "n"),
    ("completion", {"n": True}, "n"),
    ("completion", {"logprobs": "yes"}, "logprobs"),
    ("completion", {"stream": "yes"}, "stream"),
    ("completion", {"prompt": [True]}, "prompt"),
    ("completion", {"prompt": [[1, True]]}, "prompt"),
    ("chat", {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ("completion", {"stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
])
def test_a_field_of_the_wrong_type_is_a_400_naming_it(client, route, body, field):
    create = client.chat.completions.create if route == "chat" else client.completions.create
    base = CHAT if route == "chat" else COMPLETION
    with pytest.raises(openai.BadRequestError) as err:
        create(**{**base, **body})
    assert err.value.status_code == 400 and err.value.param == field
    assert field in err.value.message
    if "stream_options" in body:  # the nested field itself is named
        assert "stream_options.include_usage" in err.value.message


def test_a_number_where_a_float_goes_is_still_taken(client):
    got = client.completions.create(**{**COMPLETION, "temperature": 1, "top_p": 1, "seed": 3})
    assert got.choices[0].finish_reason in ("stop", "length")


def test_a_wrong_key_is_a_401_in_openais_shape(served):
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="sk-wrong", max_retries=0) as bad, \
            pytest.raises(openai.AuthenticationError) as err:
        bad.completions.create(**COMPLETION)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    assert "wrong API key" in err.value.message
    import httpx

    tinker_route = httpx.post(f"{served.url}/api/v1/healthz", headers={"X-API-Key": "no"})
    assert tinker_route.status_code == 401 and tinker_route.json()["category"] == "user"


def test_a_body_over_the_cap_is_a_413_in_openais_shape(served, client):
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(**{**COMPLETION, "prompt": "x " * 4000})
    assert err.value.status_code == 413 and "4096 bytes" in err.value.message
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # chunked: no length
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer "
                     b"sk-right\r\ncontent-type: application/json\r\n"
                     b"transfer-encoding: chunked\r\n\r\n1400\r\n" + b"x" * 5120 + b"\r\n")
        head = _reply(sock)
    assert head.startswith("HTTP/1.1 413")
    assert json.loads(head.split("\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"


def _reply(sock: socket.socket) -> str:
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode()


# ---------------------------------------------------------------- --adapter: the newest readable


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory, tiny_model):
    """A 3-step tiny run, every step's checkpoint kept (copied per test before damage)."""
    folder = tmp_path_factory.mktemp("fallback-run")
    path = write_config(folder, training={"max_steps": 3, "save_every": 1},
                        logging={"log_dir": str(folder / "logs")})
    assert run_app(["run", str(path)]) == 0
    return folder / "logs" / "run"


def _step_folder(run: Path, step: int) -> Path:
    point = json.loads((run / "checkpoints" / f"step-{step:06d}.json").read_text())
    return run / "checkpoints" / Path(point["checkpoint"]).name


def _no_config(folder: Path) -> str:
    (folder / "adapter_config.json").unlink()
    return "has no adapter_config.json"


def _truncated(folder: Path) -> str:
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    return "cannot load"


@pytest.mark.parametrize("damage", [_no_config, _truncated])
def test_the_newest_readable_checkpoint_is_served_and_said(three_steps, tiny_engine, tmp_path,
                                                           damage):
    run = tmp_path / "run"
    shutil.copytree(three_steps, run)
    why = damage(_step_folder(run, 3))
    store = CheckpointStore(tmp_path / "state", "tiny-random")
    [adapter] = load_adapters(tiny_engine, store, find_runs([AdapterSpec("a", run, None)])
                              ).values()
    tiny_engine.drop_snapshot(adapter.snap)
    line = adapter.fallback_line()
    assert adapter.step == 2 and line is not None
    assert "serving step 2" in line and "not step 3" in line and why in line
    with pytest.raises(UserError, match=f"step 3: .*{why}"):  # asked for by number: refused
        load_adapters(tiny_engine, store, find_runs([AdapterSpec("a", run, 3)]))


def test_no_readable_checkpoint_is_one_error(three_steps, tiny_engine, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(three_steps, run)
    for step in (1, 2, 3):
        _truncated(_step_folder(run, step))
    with pytest.raises(UserError, match="no checkpoint loads; step 3: cannot load"):
        load_adapters(tiny_engine, CheckpointStore(tmp_path / "state", "tiny-random"),
                      find_runs([AdapterSpec("a", run, None)]))
    assert not [a for a in tiny_engine.model.peft.peft_config if a.startswith("snap")]


def test_retrain_serve_says_which_step_it_serves_and_why(three_steps, model_cache, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(three_steps, run)
    _truncated(_step_folder(run, 3))
    env = {**subprocess_env(model_cache), "RETRAIN_SERVE_DIR": str(tmp_path / "state")}
    proc = warm.Popen([sys.executable, "-m", "retrain", "serve", "--model", "tiny-random",
                       "--port", "0", "--dtype", "float32", "--adapter", f"a={run}"],
                      env=env, stderr=subprocess.PIPE, text=True)
    try:
        said = []
        while not said or "retrain serve: http://" not in said[-1]:
            said.append(proc.stderr.readline())
            assert said[-1] or proc.poll() is None, "".join(said)
        url = said[-1].split("retrain serve: ")[1].split()[0]
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
            card = client.models.retrieve("a")
            got = client.completions.create(model="a", prompt="hi", max_tokens=2,
                                            temperature=0)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert card.model_extra["step"] == 2 and got.choices
    [line] = [x for x in said if x.startswith("warning: adapter 'a'")]
    assert "serving step 2" in line and "step 3: cannot load" in line

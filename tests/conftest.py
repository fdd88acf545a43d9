"""Shared fixtures: the repo root, a subprocess environment that imports this checkout,
the tiny model built once per test session into a private cache, and `retrain serve` in
this process for the tinker SDK."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytest_plugins = ["tests.cpu_report"]  # CPU seconds per test beside --durations


RAY_GROUPS = {"test_ray_slots": "ray-slots"}   # the other Ray modules: group "ray"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the node ids
def pytest_collection_modifyitems(items) -> None:
    """Under `pytest -n N --dist loadgroup` (make test): the Ray modules run one after another
    in two workers at most, the slot tests' cluster beside the runs' clusters (more at once
    missed their tests' deadlines on two cores); a module whose tests share a module-scoped
    fixture (a loaded model, a trained run, a server) runs in one worker, so that the fixture
    is built once, not once per worker."""
    for item in items:
        module = Path(str(item.fspath))
        if module.name.startswith("test_ray_"):
            item.add_marker(pytest.mark.xdist_group(RAY_GROUPS.get(module.stem, "ray")))
        elif _uses_a_shared_fixture(item):
            item.add_marker(pytest.mark.xdist_group(module.stem))


def _uses_a_shared_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d and d[-1].scope in ("module", "package", "class") for d in defs)


@pytest.fixture(scope="module", autouse=True)
def _tinker_sessions_closed(request):
    """A module that leaves a tinker client's session open fails here (after its own
    servers are down), and the session is closed, so the next module starts clean."""
    from tests.open_clients import live_tinker_sessions

    yield
    left = live_tinker_sessions()
    for holder in left:
        holder.close()
    if left:
        pytest.fail(f"{request.module.__name__} left {len(left)} tinker ServiceClient "
                    "session(s) open: close each (`with tinker.ServiceClient(...) as s:` or "
                    "`s.close(\"success\").result()`)", pytrace=False)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """A private RETRAIN_CACHE for the whole test session (tests never touch ~/.cache)."""
    path = tmp_path_factory.mktemp("retrain-cache")
    os.environ["RETRAIN_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(model_cache) -> str:
    """Folder of the built-in `tiny-random` model (built once per session)."""
    from retrain.backends.models import TINY, resolve_model

    return resolve_model(TINY)


def subprocess_env(model_cache: Path) -> dict:
    """Environment for running `python -m retrain` in a subprocess against this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["RETRAIN_CACHE"] = str(model_cache)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("TINKER_API_KEY", None)
    return env


@pytest.fixture
def cli_env(model_cache) -> dict:
    """`subprocess_env`, a fresh copy for each test."""
    return subprocess_env(model_cache)


@pytest.fixture
def python() -> str:
    return sys.executable


# ---------------------------------------------------------------- `retrain serve` in this process
# (imports inside the fixtures: the tinker SDK is optional and its modules skip without it)


@pytest.fixture
def sdk_key() -> str:
    """The API key the tinker SDK sends to a test server (a module may override it)."""
    from tests.serve_doubles import KEY

    return KEY


@pytest.fixture
def sdk_env(monkeypatch, sdk_key):
    """The tinker SDK in this process: the test key, no telemetry, no inherited base URL."""
    monkeypatch.setenv("TINKER_API_KEY", sdk_key)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)


@pytest.fixture(scope="module")
def model(tiny_model):
    """The tiny model loaded for the local backend (float32, one thread), once per module."""
    from retrain.backends.local.model import LocalModel

    return LocalModel.load(tiny_model, "float32", "cpu", 1)


@pytest.fixture(scope="module")
def tiny_engine(tiny_model):
    """The real local engine over the tiny model (loaded once per module)."""
    from retrain.backends.local.model import LocalModel
    from retrain.serve.local_engine import LocalEngine

    return LocalEngine(LocalModel.load(tiny_model, "float32", "cpu", 1), "tiny-random")


@pytest.fixture
def tiny_server(tiny_engine, tmp_path):
    """`retrain serve` over the tiny engine, for runs of the real CLI with backend = tinker."""
    from tests.serve_doubles import Served

    with Served(tiny_engine, tmp_path, hold_s=5.0) as served:
        yield served


@pytest.fixture
def tinker_cli_env(cli_env, sdk_key) -> dict:
    """`cli_env` for a subprocess that talks to a test server with the tinker SDK."""
    return {**cli_env, "TINKER_API_KEY": sdk_key, "TINKER_TELEMETRY": "0"}


# ---------------------------------------------------------------- `retrain serve` as a process

SERVE_KEY = "sk-served-tiny-8c1e"  # the key clients of `tiny_serve` send


@pytest.fixture(scope="module")
def tiny_serve(model_cache, tmp_path_factory):
    """`retrain serve --model tiny-random --api-key SERVE_KEY` as users start it, one process
    per module, for clients of its OpenAI routes (a judge, an eval harness): a
    `run_helpers.ServeProcess` (`url`; `url + "/v1"` is the openai base_url)."""
    from tests.run_helpers import serve_process

    with serve_process(model_cache, tmp_path_factory.mktemp("serve-state"),
                       "--api-key", SERVE_KEY) as served:
        yield served

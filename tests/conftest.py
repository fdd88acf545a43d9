"""Shared fixtures: the repo root, a subprocess environment that imports this checkout,
and the tiny model built once per test session into a private cache."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """A private RETRAIN_CACHE for the whole test session (tests never touch ~/.cache)."""
    path = tmp_path_factory.mktemp("retrain-cache")
    os.environ["RETRAIN_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(model_cache) -> str:
    """Folder of the built-in `tiny-random` model (built once per session)."""
    from retrain.models import TINY, resolve_model

    return resolve_model(TINY)


@pytest.fixture
def cli_env(model_cache) -> dict:
    """Environment for running `python -m retrain` in a subprocess against this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["RETRAIN_CACHE"] = str(model_cache)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("TINKER_API_KEY", None)
    return env


@pytest.fixture
def python() -> str:
    return sys.executable

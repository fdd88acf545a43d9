"""The distributed tests' reference: the 2-rank tests' run in one process (in the test's
process: it spares a process's start), once per module."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.ranked import TRAINING
from tests.run_helpers import run_in_process, write_config


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model_cache) -> Path:
    folder = tmp_path_factory.mktemp("one")
    write_config(folder, "run", training=TRAINING)
    done = run_in_process(["run.toml"], folder, {"RETRAIN_CACHE": str(model_cache)})
    assert done.returncode == 0, done.stderr
    return folder / "logs" / "run"

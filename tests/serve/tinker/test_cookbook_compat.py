"""tinker-cookbook, unmodified, against a real `retrain serve` on the tiny model.

The cookbook (0.5.8, the newest whose dependencies install here) pins transformers<=5.5.4,
so it lives in its own virtualenv: `make cookbook` creates `.venv-cookbook`, or point
$RETRAIN_COOKBOOK_PYTHON at a Python that imports `tinker_cookbook`. Without one, the
module is skipped and says how to get it. Runs: the RL recipe (`math_rl.train`,
env=arithmetic) with the `role_colon` renderer (string stop sequences, post-update KL
through compute_logprobs), with `qwen3_instruct` + PPO + one step off-policy, and stopped
and resumed from the server's checkpoint; and the
supervised loop (`supervised.train`) on a small local JSONL chat file (cross_entropy,
forward-only NLL evaluation).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import warm
from tests.run_helpers import read_serve_url

REPO = Path(__file__).resolve().parents[3]
KEY = "tml-cookbook-compat"


def _cookbook_python() -> str | None:
    candidate = os.environ.get("RETRAIN_COOKBOOK_PYTHON") or str(
        REPO / ".venv-cookbook" / "bin" / "python")
    if not Path(candidate).exists():
        return None
    probe = subprocess.run([candidate, "-c", "import tinker_cookbook"], capture_output=True)
    return candidate if probe.returncode == 0 else None


COOKBOOK = _cookbook_python()
pytestmark = pytest.mark.skipif(
    COOKBOOK is None, reason="tinker-cookbook is not installed: run `make cookbook` (creates "
    ".venv-cookbook) or set RETRAIN_COOKBOOK_PYTHON to a Python that imports tinker_cookbook")

# The cookbook's own `python -m tinker_cookbook.supervised.train` entry point is broken in
# 0.5.8 (its lambda has no type annotation, which chz needs); this is the same call, typed.
SL_DRIVER = '''
import asyncio

import chz
from tinker_cookbook.supervised import train


def run(config: train.Config) -> None:
    asyncio.run(train.main(config))


chz.nested_entrypoint(run, allow_hyphens=True)
'''


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory, model_cache):
    """`retrain serve` as users start it, on the tiny model's folder."""
    state = tmp_path_factory.mktemp("serve-state")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RETRAIN_CACHE": str(model_cache),
           "RETRAIN_SERVE_DIR": str(state), "PYTHONUNBUFFERED": "1"}
    proc = warm.Popen([sys.executable, "-m", "retrain", "serve", "--model", tiny_model,
                       "--port", "0", "--dtype", "float32"], env=env,
                      stderr=subprocess.PIPE, text=True)
    try:
        yield read_serve_url(proc, 90)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def _cookbook(args: list[str], cwd: Path, timeout: int = 420) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TINKER_BASE_URL")}
    env.update(TINKER_API_KEY=KEY, TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1")
    return subprocess.run([COOKBOOK, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("renderer,extra", [
    ("role_colon", ["compute_post_kl=True"]),
    ("qwen3_instruct", ["loss_fn=ppo", "max_steps_off_policy=1"]),
])
def test_rl_recipe_arithmetic(served, tiny_model, tmp_path, renderer, extra):
    log = tmp_path / "rl"
    out = _cookbook(["-m", "tinker_cookbook.recipes.math_rl.train", f"model_name={tiny_model}",
                     f"renderer_name={renderer}", "env=arithmetic", "group_size=4",
                     "groups_per_batch=4", "max_tokens=8", "lora_rank=8", f"base_url={served}",
                     f"log_path={log}", "max_steps=3", "eval_every=0", "save_every=0",
                     "behavior_if_log_dir_exists=delete", *extra], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Training completed successfully" in out.stderr + out.stdout
    rows = _metrics(log)
    assert rows and all(math.isfinite(r["env/all/reward/total"]) for r in rows)
    if "compute_post_kl=True" in extra:
        assert len(rows) == 3 and all(math.isfinite(r["kl_pre_post_v1"]) for r in rows)


def test_rl_recipe_resumes(served, tiny_model, tmp_path):
    """Checkpoint every step, stop, start again with more steps: it resumes from the
    server's checkpoint and reads its renderer back from the training run's metadata."""
    log = tmp_path / "rl"
    outs = [_cookbook(["-m", "tinker_cookbook.recipes.math_rl.train", f"model_name={tiny_model}",
                       "renderer_name=role_colon", "env=arithmetic", "group_size=4",
                       "groups_per_batch=2", "max_tokens=6", "lora_rank=8",
                       f"base_url={served}", f"log_path={log}", f"max_steps={steps}",
                       "eval_every=0", "save_every=1", "behavior_if_log_dir_exists=resume"],
                      tmp_path) for steps in (2, 3)]
    assert all(o.returncode == 0 for o in outs), outs[-1].stderr[-3000:]
    assert "Resumed training from tinker://" in outs[1].stderr
    assert "Could not fetch renderer metadata" not in outs[1].stderr
    assert [r["step"] for r in _metrics(log)] == [0, 1, 2]


def test_supervised_loop_on_a_local_jsonl_chat_file(served, tiny_model, tmp_path):
    chats = tmp_path / "chat.jsonl"
    chats.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {i % 7} + {i % 5}?"},
        {"role": "assistant", "content": str(i % 7 + i % 5)}]}) + "\n" for i in range(16)))
    driver = tmp_path / "sl_train.py"
    driver.write_text(SL_DRIVER)
    log = tmp_path / "sl"
    common = "dataset_builder.common_config"
    out = _cookbook([str(driver), "recipe_name=retrain_compat", f"model_name={tiny_model}",
                     "renderer_name=role_colon", f"base_url={served}", f"log_path={log}",
                     "dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder",
                     f"dataset_builder.file_path={chats}", "dataset_builder.test_size=4",
                     f"{common}.model_name_for_tokenizer={tiny_model}",
                     f"{common}.renderer_name=role_colon", f"{common}.max_length=256",
                     f"{common}.batch_size=4", "num_epochs=2", "eval_every=2", "save_every=0",
                     "lora_rank=8", "learning_rate=1e-3"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _metrics(log)
    assert len(rows) == 6  # 12 training chats, batches of 4, two epochs
    assert all(math.isfinite(r["train_mean_nll"]) and r["grad_norm"] > 0 for r in rows)
    nll = [r["test/nll"] for r in rows if "test/nll" in r]  # forward-only cross_entropy
    assert len(nll) >= 2 and nll[-1] < nll[0]

"""A multi-turn environment trains through `retrain serve` on the tinker backend, on-policy
and with max_steps_off_policy = 1 (turn 0 of the next step sampled while this one trains)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("tinker")
pytest.importorskip("retrain.run.trainer")

from tests.run_helpers import run_in_process  # noqa: E402

ENVS = Path(__file__).parents[1] / "data" / "envs"


def config(folder: Path, name: str, url: str, off_policy: int) -> Path:
    shutil.copy(ENVS / "counter_env.py", folder / "counter_env.py")
    path = folder / f"{name}.toml"
    path.write_text(f"""
[model]
name = "tiny-random"
dtype = "float32"
device = "cpu"
threads = 1
lora_rank = 8

[data]
eval_size = 2

[environment]
kind = "python"
factory = "counter_env.py:Digits"
params = {{turns = 3}}
on_length = "continue"

[training]
seed = 1
batch_size = 2
group_size = 4
max_tokens = 6
max_steps = 3
lr = 0.03
max_steps_off_policy = {off_policy}

[backend]
backend = "tinker"
base_url = "{url}"
request_timeout_s = 60

[logging]
log_dir = "logs"
""")
    return path


@pytest.mark.parametrize("off_policy", [0, 1])
def test_a_multi_turn_environment_trains_through_serve(off_policy, tiny_server, tmp_path,
                                                       sdk_env):
    path = config(tmp_path, "remote", tiny_server.url, off_policy)
    proc = run_in_process([path], tmp_path)  # the run, not its process, is tested
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "logs/remote/metrics.jsonl").read_text()
            .splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["mean_turns"] == 3 and r["env_errors"] == 0 and r["num_completions"] == 8
        assert r["episode_tokens"] > 3 * 6
    assert [r["sample_staleness"] for r in rows] == ([0, 0, 0] if not off_policy
                                                     else [0, 1, 1])
    # Step 1 trains on the weights it sampled from: multi-turn log-probs match the sampler's.
    assert rows[0]["sampler_trainer_logprob_diff"] < 1e-3
    assert "eval_mean_reward" in rows[-1]

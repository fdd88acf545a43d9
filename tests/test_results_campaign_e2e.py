"""A real tiny campaign, end to end: 2 conditions x 3 seeds of the tiny model learning the
digits reward, one with a learning rate far too small to learn. `compare` ranks them and says
the difference is real; `plot` draws the PNG.

The learning rate is 5e-2, not 1e-2: at 1e-2 the digits reward only starts to climb around
step 20 of 30 and a seed may not take off at all, so the verdict hung on the sampler's draws
(it flipped when the local sampler's draw changed). At 5e-2 each of seeds 1-9 ends above 0.9
while 1e-7 stays near 0.04 (3e-2 was still slow for some seeds, 1e-1 unstable)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("scipy")
pytest.importorskip("matplotlib")

from bench.tiny_campaign import tiny_campaign_toml  # noqa: E402
from tests.run_helpers import DIGITS_REWARD  # noqa: E402
from tests.test_campaign_plot import png_size  # noqa: E402

CONDITIONS = """
[reward]
type = "custom"
function = "digits.py:reward"
[[campaign.conditions]]
name = "lr-5e-2"
[[campaign.conditions]]
name = "lr-1e-7"
"training.lr" = 1e-7
"""


def _retrain(env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "retrain", *args], env=env, text=True,
                          capture_output=True, timeout=timeout)


def test_compare_ranks_a_real_campaign_and_plot_draws_it(tmp_path, cli_env, tiny_model):
    (tmp_path / "digits.py").write_text(DIGITS_REWARD)
    text = tiny_campaign_toml(tmp_path / "logs", "[1, 2, 3]", max_steps=30, max_workers=2,
                              training="lr = 5e-2\nsave_every = 0\neval_every = 15",
                              tables=CONDITIONS)
    text = text.replace("batch_size = 2\ngroup_size = 2", "batch_size = 4\ngroup_size = 8")
    path = tmp_path / "lr.toml"
    path.write_text(text.replace("eval_size = 0", "eval_size = 8"))
    done = _retrain(cli_env, "run", str(path), timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    camp = tmp_path / "logs" / "lr"

    report = json.loads(_retrain(cli_env, "compare", str(camp), "--json").stdout)
    good, small = report["conditions"]
    assert (good["name"], good["rank"], small["rank"]) == ("lr-5e-2", 1, 2)
    assert good["completed"] == small["completed"] == 3 and report["excluded"] == []
    diff = small["vs_baseline"][0]
    assert diff["metric"] == "final reward" and diff["hi"] < 0
    assert diff["verdict"].endswith("lr-1e-7 is lower than lr-5e-2")
    assert good["eval_accuracy"]["n"] == 3  # evaluated at steps 15 and 30
    assert good["reached"] == 3 and small["reached"] < 3

    plain = _retrain(cli_env, "compare", str(camp))
    assert plain.returncode == 0 and "lr-1e-7 vs lr-5e-2: final reward" in plain.stdout

    drawn = _retrain(cli_env, "plot", str(camp))
    assert drawn.returncode == 0, drawn.stderr
    assert png_size(camp / "curves.png") == (1300, 500)
    assert Path(drawn.stdout.split("wrote ", 1)[1].strip()) == camp / "curves.png"

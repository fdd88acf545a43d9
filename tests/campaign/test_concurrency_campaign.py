"""max_concurrent = "auto" end to end: a campaign of tinker runs against a real `retrain serve
--load-model` process whose endpoint answers 502 above 2 calls in flight. The campaign's
controller cuts its cap at once when the 502s come (AIMD), logs why, and the learned cap
survives a runner killed with SIGKILL: the re-run starts from it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

pytest.importorskip("tinker")

from retrain.campaign.concurrency import LOG_FILE, STATE_FILE, read_decisions  # noqa: E402
from retrain.slots.file_slots import read_cap  # noqa: E402
from tests import warm
from tests.run_helpers import read_serve_url  # noqa: E402
from tests.serve_doubles import KEY  # noqa: E402

CONFIG = """
[model]
name = "tiny-random"
dtype = "float32"
device = "cpu"
threads = 1

[data]
source = "arithmetic"
size = 200
eval_size = 0

[training]
batch_size = 4
group_size = 2
max_tokens = 4
max_steps = {steps}
save_every = 1000

[backend]
backend = "tinker"
base_url = "{url}"
request_timeout_s = 60
max_concurrent = "auto"
max_concurrent_min = 1
max_concurrent_max = 16

[logging]
log_dir = "logs"

[campaign]
name = "auto"
seeds = [1, 2, 3]
parallel = true
stagger_seconds = 0
"""


@pytest.fixture
def served(cli_env, python, tmp_path):
    env = {**cli_env, "RETRAIN_SERVE_DIR": str(tmp_path / "state"), "RETRAIN_SERVE_API_KEY": KEY}
    proc = warm.Popen([python, "-m", "retrain", "serve", "--model", "tiny-random",
                       "--port", "0", "--dtype", "float32", "--load-model",
                       "base_ms=100,sigma=0,kappa=0,fail_above=2"],
                      env=env, stderr=subprocess.PIPE, text=True)
    try:
        yield read_serve_url(proc, 60)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def _wait(predicate, proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_aimd_cut_on_502_and_learned_cap_survives_sigkill(served, cli_env, python, tmp_path,
                                                         sdk_key):
    env = {**cli_env, "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0"}
    (tmp_path / "auto.toml").write_text(CONFIG.format(steps=500, url=served))
    camp = tmp_path / "logs" / "auto"
    runner = warm.Popen([python, "-m", "retrain", "auto.toml"], env=env, cwd=tmp_path,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # a cap above 3 lets a 4th call in while 3 are in flight: 502s, cut at once
        _wait(lambda: any(r["errors"] for r in read_decisions(camp)), runner, 240)
        rows = read_decisions(camp)
        k = next(i for i, r in enumerate(rows) if r["errors"])
        cut, was = rows[k], rows[k - 1]["cap"] if k else 4
        assert cut["reason"].startswith("overload") and was > 3, rows[: k + 1]
        assert cut["cap"] <= min(3, was // 2), rows[: k + 1]
        assert read_cap(camp / "slots") == cut["cap"]
        _wait(lambda: len(read_decisions(camp)) > k + 2, runner, 60)
        saved = json.loads((camp / STATE_FILE).read_text())
        assert saved["cap"] <= 3 and saved["ceiling"] <= 3, saved
    finally:
        if runner.poll() is None:
            os.kill(runner.pid, signal.SIGKILL)
        runner.communicate(timeout=30)
    learned = json.loads((camp / STATE_FILE).read_text())["cap"]
    before = len(read_decisions(camp))

    again = warm.Popen([python, "-m", "retrain", "auto.toml"], env=env, cwd=tmp_path,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait(lambda: len(read_decisions(camp)) >= before + 8, again, 240)
    finally:
        again.send_signal(signal.SIGTERM)   # the runs checkpoint and stop; no need to finish
        out = again.communicate(timeout=120)[0]
    assert f"continuing from the learned cap {learned}" in out, out[-3000:]
    after = read_decisions(camp)[before:]
    assert after[0]["cap"] == learned, after[:3]
    assert max(r["cap"] for r in after) <= 3, after   # the ceiling holds too
    assert not any(r["errors"] for r in after[1:]), after        # so no more 502s
    for row in read_decisions(camp):
        assert set(row) >= {"time", "cap", "in_flight", "throughput", "sigma", "kappa",
                            "p_star", "reason"}
    assert (camp / LOG_FILE).exists()

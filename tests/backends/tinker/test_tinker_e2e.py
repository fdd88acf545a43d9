"""End to end: the real `retrain` CLI with backend = "tinker" against `retrain serve` on
127.0.0.1 (tiny model, in this process), compared with the local backend; a campaign
throttled by the API semaphore; injected faults; and the API key never leaking.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("tinker")
pytest.importorskip("retrain.run.trainer")
pytest.importorskip("retrain.control.backpressure.controller")
pytest.importorskip("retrain.campaign.runner")

from retrain.serve.door.guard import FaultPlan  # noqa: E402
from tests import warm  # noqa: E402
from tests.run_helpers import run_in_process  # noqa: E402

KEY = f"tml-e2e-{secrets.token_hex(12)}"   # unique, so any leak is found by a plain search

REWARD = '''def digits(completion: str, answer: str) -> float:
    """Fraction of digit characters: the tiny model learns it in a few dozen steps."""
    text = completion.strip()
    return sum(ch.isdigit() for ch in text) / max(1, len(text))
'''


def write_config(folder: Path, name: str, *, backend: str, url: str = "", steps: int = 30,
                 seed: int = 1, timeout_s: float = 30, extra: str = "") -> Path:
    (folder / "reward.py").write_text(REWARD)
    path = folder / f"{name}.toml"
    path.write_text(f"""
[model]
name = "tiny-random"
dtype = "float32"
device = "cpu"
threads = 1
lora_rank = 8

[data]
source = "arithmetic"
size = 200
eval_size = 0

[reward]
type = "custom"
function = "reward.py:digits"

[training]
seed = {seed}
batch_size = 4
group_size = 8
max_tokens = 10
max_steps = {steps}
lr = 0.03

[backend]
backend = "{backend}"
base_url = "{url}"
request_timeout_s = {timeout_s}

[logging]
log_dir = "logs"
{extra}
""")
    return path


@pytest.fixture
def sdk_key() -> str:
    return KEY


class Outputs:
    """Every subprocess's stdout + stderr, to search for the key afterwards."""

    def __init__(self):
        self.texts: list[str] = []

    def run(self, python, args, env, cwd, timeout=180) -> subprocess.CompletedProcess:
        proc = warm.run([python, "-m", "retrain", *args], env=env, cwd=cwd,
                        capture_output=True, text=True, timeout=timeout)
        self.texts += [proc.stdout, proc.stderr]
        return proc

    def start(self, python, args, env, cwd) -> subprocess.Popen:
        return warm.Popen([python, "-m", "retrain", *args], env=env, cwd=cwd,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def finish(self, proc: subprocess.Popen, timeout=180) -> int:
        out, err = proc.communicate(timeout=timeout)
        self.texts += [out, err]
        return proc.returncode


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def state(run_dir: Path) -> dict:
    return json.loads((run_dir / "state.json").read_text())


def assert_key_never_leaked(folder: Path, outputs: Outputs) -> None:
    """Test (5): not in any file under the log folder, not in any output."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert files
    for p in files:
        assert KEY.encode() not in p.read_bytes(), f"API key written to {p}"
    for text in outputs.texts:
        assert KEY not in text, "API key printed"


def mean(xs) -> float:
    return sum(xs) / len(xs)


STEPS = 50  # the learning test's steps


def test_tinker_run_learns_like_the_local_backend(tiny_server, tmp_path, tinker_cli_env, python):
    """Test (2): same task, same seed; both reward curves rise from ~0.05 to well above 0.5.
    50 steps: at 30, 5 of 18 seeds of the local run were still below 0.5 (0.23-0.45, the
    draws decide when learning takes off); each of those 5 was at 0.95 or more by step 50."""
    out = Outputs()
    write_config(tmp_path, "local", backend="local", steps=STEPS)
    write_config(tmp_path, "remote", backend="tinker", url=tiny_server.url, steps=STEPS)
    remote = out.start(python, ["remote.toml"], tinker_cli_env, tmp_path)
    local = run_in_process(["local.toml"], tmp_path)  # meanwhile, in this process
    out.texts += [local.stdout, local.stderr]
    codes = [local.returncode, out.finish(remote)]
    assert codes == [0, 0], out.texts[-4:]
    local, remote = rows(tmp_path / "logs/local"), rows(tmp_path / "logs/remote")
    assert [r["step"] for r in remote] == list(range(1, STEPS + 1))
    curves = {}
    for name, rs in (("local", local), ("remote", remote)):
        rewards = [r["mean_reward"] for r in rs]
        curves[name] = (mean(rewards[:5]), mean(rewards[-5:]))
        assert curves[name][0] < 0.15 and curves[name][1] > 0.5, (name, rewards)
    # sampling draws differ between the two, so the curves match in shape, not step by step
    assert abs(curves["local"][1] - curves["remote"][1]) < 0.35, curves
    # on-policy: the service's trainer log-probs match its sampler's
    diffs = [r["sampler_trainer_logprob_diff"] for r in remote
             if r["sampler_trainer_logprob_diff"] is not None]
    assert diffs and max(diffs) < 1e-3
    assert state(tmp_path / "logs/remote")["checkpoint"].startswith("tinker://")
    assert_key_never_leaked(tmp_path / "logs", out)


def test_campaign_never_exceeds_max_concurrent(tiny_server, tmp_path, tinker_cli_env, python):
    """Test (3): 3 tinker runs, 3 workers, max_concurrent = 2: the server never has more
    than 2 of the campaign's requests in flight."""
    out = Outputs()
    cfg = write_config(tmp_path, "camp", backend="tinker", url=tiny_server.url, steps=4,
                       extra="\n[campaign]\nseeds = [1, 2, 3]\nparallel = true\n"
                             "max_workers = 3\nstagger_seconds = 0\n")
    text = cfg.read_text().replace("request_timeout_s", "max_concurrent = 2\nrequest_timeout_s")
    cfg.write_text(text)
    tiny_server.traffic.reset_peak()
    before = tiny_server.traffic.requests
    proc = out.run(python, [cfg.name], tinker_cli_env, tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((tmp_path / "logs/camp/manifest.json").read_text())
    assert [r["status"] for r in manifest["runs"]] == ["completed"] * 3
    assert tiny_server.traffic.requests - before > 3 * 4 * 5  # every run talked to the server
    assert tiny_server.traffic.peak <= 2, tiny_server.traffic.peak
    assert tiny_server.traffic.peak == 2  # and the two slots were used in parallel
    assert_key_never_leaked(tmp_path / "logs", out)


def test_injected_429_502_504_are_survived(tiny_server, tmp_path, tinker_cli_env, python):
    """Test (4a): a run survives transient errors on every route by retrying."""
    out = Outputs()
    tiny_server.app.faults = FaultPlan(rates={"429": 0.03, "502": 0.04, "504": 0.04}, seed=11)
    cfg = write_config(tmp_path, "flaky", backend="tinker", url=tiny_server.url, steps=8)
    proc = out.run(python, [cfg.name], tinker_cli_env, tmp_path)
    tiny_server.app.faults = None
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "logs/flaky"
    assert [r["step"] for r in rows(run)] == list(range(1, 9))
    assert state(run)["status"] == "completed"
    assert all(tiny_server.traffic.faults.get(k, 0) > 0 for k in ("429", "502", "504")), \
        tiny_server.traffic.faults
    assert_key_never_leaked(tmp_path / "logs", out)


def test_a_hung_request_stops_cleanly_and_resumes(tiny_server, tmp_path, tinker_cli_env, python):
    """Test (4b): a request that hangs hits backend.request_timeout_s; the run stops with
    its last checkpoint, and the same command resumes it without losing or repeating a step."""
    out = Outputs()
    tiny_server.app.faults = FaultPlan(rates={"hang": 1.0}, routes=frozenset({"optim_step"}),
                                  after=3, limit=1, hang_s=60)
    cfg = write_config(tmp_path, "hang", backend="tinker", url=tiny_server.url, steps=6,
                       timeout_s=3)
    first = out.run(python, [cfg.name], tinker_cli_env, tmp_path)
    assert first.returncode == 1
    assert "request_timeout_s" in first.stderr and "resumes" in first.stderr
    run = tmp_path / "logs/hang"
    s = state(run)
    assert s["status"] == "failed" and s["step"] == 3
    assert s["checkpoint"].startswith("tinker://") and s["checkpoint"].endswith("step-000003")
    second = out.run(python, [cfg.name], tinker_cli_env, tmp_path)
    tiny_server.app.faults = None
    assert second.returncode == 0, second.stderr[-3000:]
    assert [r["step"] for r in rows(run)] == list(range(1, 7))
    assert state(run)["status"] == "completed"
    assert tiny_server.traffic.faults.get("hang") == 1
    assert_key_never_leaked(tmp_path / "logs", out)

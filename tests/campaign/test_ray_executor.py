"""Campaigns on a real multi-node Ray cluster (ray.cluster_utils.Cluster: several raylets on
this machine), through the real CLI on the tiny model: placement over nodes, a node removed
mid-run, a killed driver, the slot actor across nodes, the judge budget shared by runs on
every node, and the shared-storage check.

One cluster for the whole module: a head with no CPU (it hosts the drivers and the slot actor)
and two 1-CPU worker nodes, so runs land on the workers and a removed worker can be replaced.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'retrain[ray]')")

from bench.campaign.tiny import tiny_campaign_toml  # noqa: E402
from retrain.campaign.manifest import load_manifest  # noqa: E402
from retrain.runfiles import runlog  # noqa: E402
from tests import warm  # noqa: E402
from tests.judge_server import RUBRIC, JudgeServer  # noqa: E402
from tests.run_helpers import wait_until  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NODE_ARGS = {"num_cpus": 1, "object_store_memory": 80 * 2**20}

REWARD_TABLE = """
[reward]
type = "custom"
function = "{function}:reward"
timeout_s = 600.0
"""

REWARD = """
import os, time
def reward(completion, answer):
    time.sleep(float(os.environ.get("RETRAIN_TEST_REWARD_DELAY", "0")))
    return sum(ch.isdigit() for ch in completion) / len(completion) if completion else 0.0
"""


@pytest.fixture(scope="module")
def cluster(tiny_model):
    from ray.cluster_utils import Cluster

    os.environ["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 80 * 2**20, "include_dashboard": False})
    for _ in range(2):
        c.add_node(**NODE_ARGS)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="retrain", log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture
def env(cli_env, cluster) -> dict:
    return {**cli_env, "RAY_ADDRESS": cluster.address}


def _campaign(tmp: Path, *, max_steps: int = 3, seeds: str = "[1, 2, 3, 4]") -> Path:
    (tmp / "score.py").write_text(REWARD)
    path = tmp / "exp.toml"
    path.write_text(tiny_campaign_toml(tmp / "logs", seeds, max_steps=max_steps, max_workers=4,
                                       training="save_every = 1", campaign='executor = "ray"',
                                       tables=REWARD_TABLE.format(function=tmp / "score.py")))
    return path


def _retrain(env: dict, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return warm.run([sys.executable, "-m", "retrain", *args], env=env, text=True,
                    capture_output=True, timeout=timeout)


def _start(env: dict, path: Path, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return warm.Popen([sys.executable, "-m", "retrain", str(path)], env=env,
                          stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _steps(run_dir: Path) -> list[int]:
    lines = (run_dir / runlog.METRICS_FILE).read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.strip()]


def _running_at_step(campaign: Path, step: int):
    """The manifest's running entry once it is placed and its run has passed `step`."""
    m = load_manifest(campaign) if (campaign / runlog.MANIFEST_FILE).exists() else None
    for e in (m.runs if m else []):
        state = runlog.load_state(campaign / e.name)
        if e.status == "running" and e.node and state is not None and state.step >= step:
            return e
    return None


def test_campaign_spreads_over_nodes_and_runs_every_step_once(tmp_path, env):
    path = _campaign(tmp_path, seeds="[1, 2]", max_steps=2)  # 2 at once: one per 1-CPU node
    done = _retrain(env, str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    campaign = tmp_path / "logs" / "exp"
    m = load_manifest(campaign)
    assert m.executor == "ray" and m.slots_actor and m.status == "completed"
    worker_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]
                    and n["Resources"].get("CPU", 0) > 0}
    assert len(m.runs) == 2 and {e.node for e in m.runs} == worker_nodes  # one run each
    for e in m.runs:
        assert e.status == "completed" and e.attempts == 1 and e.host
        assert [p["node"] for p in e.placements] == [e.node]
        assert _steps(campaign / e.name) == [1, 2]
    # The slot actor and every run actor are gone once the campaign ended.
    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    assert not any(m.slots_actor in n or n.startswith("run:") for n in names), names


def test_removed_node_run_is_retried_elsewhere_and_resumes_exactly(tmp_path, env, cluster):
    path = _campaign(tmp_path, seeds="[1]", max_steps=5)
    campaign = tmp_path / "logs" / "exp"
    driver = _start({**env, "RETRAIN_TEST_REWARD_DELAY": "0.15"}, path, tmp_path / "out.txt")
    try:
        entry = wait_until(lambda: _running_at_step(campaign, 2), 120, "step 2 on a node")
        (victim,) = [n for n in cluster.worker_nodes if n.node_id == entry.node]
        cluster.remove_node(victim)
        assert driver.wait(timeout=180) == 0, (tmp_path / "out.txt").read_text()
    finally:
        if driver.poll() is None:
            driver.kill()
        cluster.add_node(**NODE_ARGS)  # back to two workers for the next tests
        cluster.wait_for_nodes()
    out = (tmp_path / "out.txt").read_text()
    (e,) = load_manifest(campaign).runs
    assert e.status == "completed" and e.attempts == 2 and e.failures == 1, out
    assert [p["attempt"] for p in e.placements] == [1, 2]
    assert e.placements[0]["node"] == entry.node != e.placements[1]["node"]
    assert "retrying on another node" in out
    assert _steps(campaign / e.name) == [1, 2, 3, 4, 5]  # resumed: no step lost or twice


def test_killed_driver_rerun_adopts_the_running_runs(tmp_path, env):
    path = _campaign(tmp_path, seeds="[1, 2]", max_steps=4)
    campaign = tmp_path / "logs" / "exp"
    slow = {**env, "RETRAIN_TEST_REWARD_DELAY": "0.3"}  # still running while status looks
    driver = _start(slow, path, tmp_path / "first.txt")
    wait_until(lambda: _running_at_step(campaign, 1), 120, "a run at step 1")
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    status = _retrain(env, "status", str(tmp_path / "logs"))
    running = [e for e in load_manifest(campaign).runs if e.status == "running"]
    assert "API slots 0/4 in use" in status.stdout, status.stdout + status.stderr
    assert "node" in status.stdout and f"{running[0].host} ({running[0].node[:8]})" in status.stdout
    again = _retrain(slow, str(path))
    assert again.returncode == 0, again.stdout + again.stderr
    explain = _retrain(env, "explain", str(path))
    assert "ray: 3 node(s), 2 CPU, 0 GPU; each run asks cpu = 1, gpu = 0; 2 run(s) fit at " \
           "once" in explain.stdout, explain.stdout + explain.stderr
    assert "still running from a previous runner" in again.stdout
    for e in load_manifest(campaign).runs:
        assert e.status == "completed", again.stdout
        assert _steps(campaign / e.name) == [1, 2, 3, 4]
    adopted = [e for e in load_manifest(campaign).runs if e.attempts == 1
               and len(e.placements) == 1]
    assert adopted, "no run was adopted: a second copy was started"


def test_folder_not_shared_with_a_node_stops_before_launching(tmp_path, env, cluster):
    """A node in its own mount namespace, with an empty tmpfs over the log folder's parent."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to give one node its own view of the file system")
    hidden = tmp_path / "shared"
    hidden.mkdir()
    ray_cli = str(Path(sys.executable).with_name("ray"))
    base = ["unshare", "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        base[1:1] = ["--user", "--map-root-user"]
    node = subprocess.Popen(
        [*base, "sh", "-c", f"mount -t tmpfs none {hidden} && exec {ray_cli} start "
         f"--address={cluster.address} --num-cpus=0 --object-store-memory={80 * 2**20} --block"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        alive = len([n for n in ray.nodes() if n["Alive"]])
        try:
            wait_until(lambda: len([n for n in ray.nodes() if n["Alive"]]) > alive
                      or node.poll() is not None, 60, "the namespaced node")
        except AssertionError:
            pytest.skip("could not start a Ray node in its own mount namespace")
        if node.poll() is not None:
            pytest.skip("unshare is not permitted here: " + node.stderr.read().decode()[-300:])
        path = _campaign(hidden, seeds="[1]")
        failed = _retrain(env, str(path))
        assert failed.returncode == 2, failed.stdout + failed.stderr
        folder = hidden / "logs" / "exp"
        assert f"{folder}: logging.log_dir is not shared with every Ray node" in failed.stderr
        assert "NFS" in failed.stderr and 'executor = "local"' in failed.stderr
        assert not (folder / "seed1").exists() or not any((folder / "seed1").iterdir())
    finally:
        with contextlib.suppress(ProcessLookupError):  # a node that failed to start is gone
            os.killpg(node.pid, signal.SIGTERM)
        node.wait(timeout=60)


def test_ctrl_c_checkpoints_the_runs_and_leaves_no_actor(tmp_path, env):
    path = _campaign(tmp_path, seeds="[1]", max_steps=3)
    campaign = tmp_path / "logs" / "exp"
    slow = {**env, "RETRAIN_TEST_REWARD_DELAY": "0.1"}
    driver = _start(slow, path, tmp_path / "out.txt")
    wait_until(lambda: _running_at_step(campaign, 1), 120, "a run at step 1")
    driver.send_signal(signal.SIGINT)
    assert driver.wait(timeout=120) == 130, (tmp_path / "out.txt").read_text()
    (e,) = load_manifest(campaign).runs
    assert e.status == "interrupted" and e.failures == 0
    assert runlog.load_state(campaign / e.name).status == "interrupted"  # it checkpointed
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert not [n for n in names if n.startswith("run:") or n.startswith("slots:")], names
    again = _retrain(slow, str(path))
    assert again.returncode == 0, again.stdout + again.stderr
    assert _steps(campaign / e.name) == [1, 2, 3]


JUDGE_TABLE = """
[reward]
type = "judge"
[reward.judge]
base_url = "{url}"
model = "judge"
rubric = {rubric}
max_concurrent = 2
api_key_env = "RAY_JUDGE_KEY"
"""


def test_runs_on_every_node_share_the_judge_budget(tmp_path, env):
    """3 runs at once over 2 nodes (half a CPU each: 2 fit on a node, so both nodes run
    one), judge.max_concurrent = 2: never more than 2 requests in flight at the judge,
    counted there; the key's variable reaches the runs on the nodes; the judge's slot actor
    is gone once the campaign ends."""
    server = JudgeServer()
    server.delay_s = 1.0  # the runs' judging overlaps: 12 requests take >= 6 s at 2 at once
    try:
        path = tmp_path / "exp.toml"
        path.write_text(tiny_campaign_toml(
            tmp_path / "logs", "[1, 2, 3]", max_steps=1, max_workers=3,
            campaign='executor = "ray"\nrun_resources = {cpu = 0.5}',
            tables=JUDGE_TABLE.format(url=server.base_url, rubric=json.dumps(RUBRIC))))
        done = _retrain({**env, "RAY_JUDGE_KEY": "sk-ray-judge"}, str(path), timeout=400)
        assert done.returncode == 0, done.stdout + done.stderr
        assert server.requests == 3 * 1 * 4  # 3 runs x 1 step x batch 2 x group 2
        assert server.max_in_flight == 2 and server.auth == {"Bearer sk-ray-judge"}
    finally:
        server.close()
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert not [n for n in names if "slots:" in n or n.startswith("run:")], names

"""The Ray executor reserves a run's ranks: a run of 2 ranks ([distributed] nproc_per_node)
is one actor asking twice the per-rank resources, so its worker's 2 processes share a node
(and, on cuda, see the 2 GPUs Ray gave the actor); a second such run waits until the first
has ended. A real local Ray cluster of 3 CPUs; the worker is a sleeping stand-in."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'retrain[ray]')")

from retrain.campaign.executor import Job  # noqa: E402
from retrain.campaign.ray_executor import RayExecutor  # noqa: E402
from retrain.config.loader import loads  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]  # then the config's path


@pytest.fixture(scope="module")
def cluster():
    short = Path(tempfile.mkdtemp(prefix="rk", dir="/tmp"))  # Ray's socket paths stay short
    os.environ["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    ray.init(num_cpus=3, num_gpus=0, include_dashboard=False, log_to_driver=False,
             object_store_memory=80 * 2**20, _temp_dir=str(short), namespace="retrain")
    yield
    ray.shutdown()
    shutil.rmtree(short, ignore_errors=True)


def _until(what, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _free_cpus() -> float:
    return ray.available_resources().get("CPU", 0.0)


def test_a_two_rank_run_holds_two_cpus_and_a_second_one_waits(cluster, tmp_path):
    cfg, plan = loads('[model]\ndevice = "cpu"\n[distributed]\nnproc_per_node = 2\n'
                      '[campaign]\nseeds = [1, 2]\nexecutor = "ray"\n')
    executor = RayExecutor(tmp_path / "camp", cfg, plan, command=SLEEPER)
    assert (executor.cpu, executor.gpu) == (1.0, 0.0)  # per rank

    def job(name: str) -> Job:
        (tmp_path / name).mkdir()
        return Job(name, tmp_path / name / "config.toml", tmp_path / name / "worker.log",
                   attempt=1, ranks=2)

    first = executor.launch(job("a"))
    try:
        _until(first.placement)
        _until(lambda: _free_cpus() == 1.0)  # 3 - the 2 ranks' CPUs, held by its actor
        second = executor.launch(job("b"))
        try:
            time.sleep(2.0)
            assert second.placement() is None and second.poll() is None  # 1 CPU free: waits
            first.kill()
            _until(second.placement)  # the first run's 2 CPUs went to it
            assert _free_cpus() == 1.0
        finally:
            second.kill()
    finally:
        first.kill()
    _until(lambda: _free_cpus() == 3.0)


def test_a_campaign_of_two_rank_runs_runs_on_the_cluster(cluster, tmp_path, cli_env,
                                                         tiny_model):
    """The real thing end to end: the CLI's campaign on this cluster, a 2-rank run through
    the real worker (which starts its ranks itself), rows written by rank 0."""
    import json
    import subprocess

    from bench.campaign.tiny import tiny_campaign_toml

    path = tmp_path / "exp.toml"
    path.write_text(tiny_campaign_toml(tmp_path / "logs", "[1]", max_steps=1, max_workers=2,
                                       campaign='executor = "ray"',
                                       tables="[distributed]\nnproc_per_node = 2\n"))
    address = ray.get_runtime_context().gcs_address
    done = subprocess.run([sys.executable, "-m", "retrain", str(path)], capture_output=True,
                          text=True, timeout=300, env={**cli_env, "RAY_ADDRESS": address})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    [run] = [p for p in (tmp_path / "logs" / "exp").iterdir() if p.is_dir()]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    assert [r["step"] for r in rows] == [1] and rows[0]["world_size"] == 2

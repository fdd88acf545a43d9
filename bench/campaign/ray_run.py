"""Benchmark the Ray executor against the local one on a 3-node Ray cluster on this machine.

    python -m bench.campaign.ray_run                      # 20 trivial runs + an 8-run tiny campaign
    python -m bench.campaign.ray_run --runs 20 --tiny-runs 0

1. Scheduling overhead per run: N trivial runs (the stdlib worker of bench/campaign/overhead.py,
   which writes a completed state.json and exits) as a serial campaign through `run_campaign`,
   with the local executor and with the Ray executor; overhead = (wall - baseline) / N, where
   the baseline is the same processes run back to back.
2. Wall time of an 8-run campaign of the real tiny model (`tiny-random`, 3 steps each) with
   max_workers = 3: local executor vs Ray executor on 3 nodes of 1 CPU each (Ray's nodes here
   share this machine's cores, so this measures the executor's cost, not a speed-up).
The cluster is started once (ray.cluster_utils.Cluster) and shut down at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.campaign.overhead import CAMPAIGN, WORKER, baseline  # noqa: E402
from bench.campaign.tiny import tiny_campaign_toml  # noqa: E402
from retrain.campaign.executor import LocalExecutor  # noqa: E402
from retrain.campaign.runner import locate_campaign, run_campaign  # noqa: E402
from retrain.config.loader import load  # noqa: E402


def timed_campaign(path: Path, executor) -> float:
    cfg, plan = load(path)
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = run_campaign(cfg, plan, path, executor=executor)
    wall = time.perf_counter() - t0
    assert code == 0, f"{path} failed with {code}"
    return wall


def trivial(tmp: Path, worker: Path, runs: int, kind: str) -> float:
    from retrain.campaign.ray_executor import RayExecutor

    path = tmp / f"trivial-{kind}.toml"
    path.write_text(CAMPAIGN.format(log_dir=tmp / kind, seeds=list(range(runs)),
                                    parallel="false"))
    command = [sys.executable, str(worker)]
    if kind == "local":
        return timed_campaign(path, LocalExecutor(command))
    cfg, plan = load(path)
    folder = locate_campaign(tmp / kind, path.stem, new=False)
    folder.mkdir(parents=True, exist_ok=True)
    return timed_campaign(path, RayExecutor(folder, cfg, plan, command))


def tiny(tmp: Path, runs: int, kind: str) -> float:
    path = tmp / f"tiny-{kind}.toml"
    path.write_text(tiny_campaign_toml(tmp / f"tiny-{kind}", list(range(1, runs + 1)),
                                       max_steps=3, max_workers=3,
                                       campaign=f'executor = "{kind}"'))
    return timed_campaign(path, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--tiny-runs", type=int, default=8)
    args = ap.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    from retrain.backends.models import TINY, resolve_model

    resolve_model(TINY)  # built once, before any timing
    os.environ["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": 80 * 2**20, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20)
    cluster.wait_for_nodes()
    os.environ["RAY_ADDRESS"] = cluster.address
    print(f"3-node cluster up in {time.perf_counter() - t0:.1f}s")
    try:
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            worker = tmp / "worker.py"
            worker.write_text(WORKER)
            n = args.runs
            base = baseline(tmp, worker, n)
            local = trivial(tmp, worker, n, "local")
            on_ray = trivial(tmp, worker, n, "ray")
            print(f"{n} trivial runs, serial: baseline {base:.2f}s; local campaign {local:.2f}s "
                  f"({1000 * (local - base) / n:.0f} ms/run overhead); ray campaign "
                  f"{on_ray:.2f}s ({1000 * (on_ray - base) / n:.0f} ms/run overhead)")
            if args.tiny_runs:
                a = tiny(tmp, args.tiny_runs, "local")
                b = tiny(tmp, args.tiny_runs, "ray")
                print(f"{args.tiny_runs}-run tiny campaign, max_workers 3: local {a:.1f}s, "
                      f"ray (3 nodes x 1 CPU) {b:.1f}s")
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()

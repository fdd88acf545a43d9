"""Two torchrun "nodes" on localhost, as a user starts a job on two machines, equal one
process (a module of its own: it runs beside test_ranked_run.py in the suite)."""

from __future__ import annotations

import socket
import subprocess

from tests.distributed.ranked import TRAINING, same_run, torchrun
from tests.run_helpers import write_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_localhost_equal_one_process(tmp_path, reference, cli_env, python):
    """torchrun --nnodes 2 as a user starts a job on two machines, here both on localhost,
    each node with its own folder (rank 0's is the run's)."""
    port = _free_port()
    nodes = []
    for node in (0, 1):
        folder = tmp_path / f"node{node}"
        folder.mkdir()
        write_config(folder, "run", training=TRAINING)
        nodes.append(subprocess.Popen(
            torchrun(python, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
                      "1", "--master-addr", "127.0.0.1", "--master-port", str(port)),
            cwd=folder, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
    outs = [p.communicate(timeout=300) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    same_run(reference, tmp_path / "node0" / "logs" / "run")
    assert not (tmp_path / "node1" / "logs").exists()  # no rank but 0 writes



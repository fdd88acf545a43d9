"""`retrain FILE.toml` with [distributed] nproc_per_node > 1: start the ranks on this node
through torch's elastic launcher (torchrun's own library), each running the same command
under torchrun's environment, and wait for them. No process manager of our own: the agent
watches the ranks, and when one fails it stops the others."""

from __future__ import annotations

import signal
import sys
import uuid

from retrain.errors import UserError


def start_ranks(nproc: int, argv: list[str]) -> int:
    """Run `python -m retrain *argv` as `nproc` ranks; returns the run's exit status (rank
    0's, or the failed rank's, named on stderr)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          run_id=f"retrain-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.5)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "retrain", *argv)
    except ChildFailedError as exc:
        return _failed(exc.failures)
    except Exception as exc:  # the agent's own failure: rendezvous, a signal
        name = type(exc).__name__
        if name == "SignalException":
            return 128 + int(getattr(exc, "sigval", signal.SIGINT))
        raise UserError(f"the launcher of the {nproc} ranks failed: {exc}", exit_code=1) from exc
    return 0


def _cause(rank: int, exitcode: int) -> int:
    """How likely an ending is the first failure: killed from outside (SIGKILL, the OOM
    killer, a crash); rank 0's own one-line error (status 2: a bad file, a held lock; every
    rank may hit it); a rank other than 0 that exited with an error; rank 0's other failures
    (it also fails when another rank is gone); the agent's own SIGTERM to the rest."""
    if exitcode < 0 and exitcode != -signal.SIGTERM:
        return 0
    if exitcode == UserError.exit_code and rank == 0:
        return 1
    if exitcode > 0:
        return 2 if rank else 3
    return 4


def _failed(failures: dict) -> int:
    """The run's status: the rank that failed first, named here (its own output is above); a
    rank 0 that failed on its own said why itself. Timestamps are whole seconds, so the
    cause is told from the consequences by how each ended (`_cause`)."""
    rank = min(failures, key=lambda r: (_cause(r, failures[r].exitcode),
                                        failures[r].timestamp, r))
    f = failures[rank]
    if rank == 0 and f.exitcode > 0:
        return f.exitcode
    how = f"was killed by signal {-f.exitcode}" if f.exitcode < 0 else \
        f"exited with status {f.exitcode}"
    print(f"retrain: rank {rank} (pid {f.pid}) {how}; the launcher stopped every rank. The "
          "run folder keeps its last checkpoint: rerun the same command to resume",
          file=sys.stderr, flush=True)
    return f.exitcode if f.exitcode > 0 else 1

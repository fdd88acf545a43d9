"""Where campaign workers run. The runner only sees `Executor.launch(job) -> Worker`.

`LocalExecutor` starts each run as a child process on this machine; `ray_executor.RayExecutor`
implements the same two small protocols on a Ray cluster. Optional executor hooks the runner
uses when present: `prepare(max_concurrent)`, `worker_env(max_concurrent)`,
`adopt(name, attempt)`, `close(finished)`; a worker may have `placement()` and `lost`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from retrain.runfiles import runlog


@dataclass
class Job:
    """One worker to start: run the single-run config at `config_path`, log to `log_path`."""

    name: str
    config_path: Path
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)   # added to the runner's environment
    attempt: int = 0   # which attempt of the run this is (the Ray executor names actors by it)
    ranks: int = 1     # its processes ([distributed] nproc_per_node): Ray reserves for each


class Worker(Protocol):
    """A started worker."""

    pid: int

    def poll(self) -> int | None:
        """The exit status once it has ended (negative: killed by that signal), else None."""

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM: the trainer checkpoints and exits)."""

    def kill(self) -> None:
        """Stop it now."""


class Executor(Protocol):
    def launch(self, job: Job) -> Worker: ...


class LocalWorker:
    """A child process."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.pid = proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        _signal(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        _signal(self.pid, signal.SIGKILL)
        self.proc.wait()


class LocalExecutor:
    """Runs `<command> <config>` (default `python -m retrain run <config>`) per job.

    Workers get their own session, so a Ctrl-C in the terminal reaches only the runner,
    which forwards SIGTERM and waits for each worker to checkpoint.
    """

    def __init__(self, command: list[str] | None = None, cwd: str | Path | None = None):
        self.command = command or [sys.executable, "-m", "retrain", "run"]
        self.cwd = Path(cwd) if cwd else Path.cwd()

    def launch(self, job: Job) -> Worker:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **job.env}
        job.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(job.log_path, "ab") as log:
            proc = subprocess.Popen([*self.command, str(job.config_path)], cwd=self.cwd, env=env,
                                    stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return LocalWorker(proc)


class AdoptedWorker:
    """A worker left running by a runner that was killed: watched by pid, not waited for.

    Its real exit status is unknown, so `poll` derives one from its state.json: 0 completed,
    1 failed, 143 anything else (stopped or killed before it could say; the runner resumes it).
    """

    adopted = True

    def __init__(self, pid: int, config_path: Path):
        self.pid = pid
        self.config_path = config_path

    def poll(self) -> int | None:
        if is_worker_of(self.pid, self.config_path):
            return None
        state = runlog.load_state(self.config_path.parent)
        status = state.status if state is not None else ""
        return {"completed": 0, "failed": 1}.get(status, 128 + signal.SIGTERM)

    def terminate(self) -> None:
        _signal(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        _signal(self.pid, signal.SIGKILL)


def is_worker_of(pid: int, config_path: Path) -> bool:
    """Whether `pid` is alive and is the worker for `config_path` (guards against pid reuse;
    a zombie has an empty command line, so it counts as gone)."""
    if not runlog.pid_alive(pid):
        return False
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not cmdline.parent.is_dir():
        return True  # no /proc (macOS): a live pid recorded by the manifest is the best we know
    try:
        args = cmdline.read_bytes().split(b"\0")
    except OSError:
        return False
    return str(config_path).encode() in args


def find_worker(config_paths: list[Path]) -> tuple[int, Path] | None:
    """A live process (not this one) whose command line names one of `config_paths`: a worker a
    killed runner started but had not recorded yet. None when there is none, or no /proc."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    wanted = {str(p).encode(): p for p in config_paths}
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        found = next((wanted[a] for a in args if a in wanted), None)
        if found is not None:
            return int(entry.name), found
    return None


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)

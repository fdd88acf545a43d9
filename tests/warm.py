"""`python -m retrain ...` for the tests, started from a warm interpreter.

A fresh `python -m retrain run` spends ~5 of its ~6 CPU-seconds importing torch, transformers
and peft; the suite starts over a hundred of them. `Popen` and `run` take subprocess's
arguments and, for `[sys.executable, "-m", "retrain", ...]`, fork the process from a zygote
(tests/warm_zygote.py) that imported all that once: a real process of its own (its pid, session,
signals, working folder, environment, streams and command line), running the real CLI from
`retrain/__main__.py`, minus the imports. Anything else, or an environment whose variables are
read when those libraries import (threads, instruction sets, caches, paths), starts cold
through subprocess, as do tests of start-up itself (import-time output, Ctrl-C during imports,
what a command imports), which call subprocess directly.

A campaign runner started this way launches its workers warm too: in the child, `LocalExecutor`
starts them through here.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ZYGOTE = REPO / "tests" / "warm_zygote.py"
SOCKET_ENV = "RETRAIN_TEST_ZYGOTE"   # set in the children: where their own launches go
ROOT_ENV = "RETRAIN_TEST_ZYGOTE_ROOT"   # the test-started child a warm child was started for
# Read when torch, transformers, tokenizers, OpenMP or Python start: a child of the zygote would
# silently keep the zygote's values, so a request that differs in any of these starts cold.
IMPORT_TIME = ("OMP_", "KMP_", "MKL_", "OPENBLAS_", "ATEN_", "TORCH", "CUDA", "HF_",
               "TRANSFORMERS_", "TOKENIZERS_", "PYTHON", "LD_", "MALLOC")
HANDLED = {"PYTHONUNBUFFERED",          # a child's streams are made anew from it
           "PYTHONBREAKPOINT",          # read at each breakpoint() (ray.init sets it)
           "TORCHINDUCTOR_CACHE_DIR",   # read when inductor compiles (retrain sets it then)
           "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",   # retrain's HF source sets them, and the
                                                      # libraries' own flags, when it loads
           # scikit-learn, joblib and threadpoolctl setdefault these when a test imports them;
           # they are read only by Intel's OpenMP runtime, which torch (GNU libgomp) never loads
           "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK"}
SUPPORTED = {"cwd", "env", "stdin", "stdout", "stderr", "text", "universal_newlines",
             "encoding", "errors", "start_new_session", "bufsize"}
CPU_S = [0.0]   # CPU seconds of warm children that ended (tests/cpu_report.py counts them)
COUNTS = {"forked": 0, "cold": 0, "zygotes": 0}   # `python -m retrain` launches, as they went

MAX_ZYGOTES = 2   # per test process: each holds ~0.5 GB and cost a cold start
ZYGOTE_START_S = 300.0   # its imports take ~5 s on an idle machine


def Popen(args, **kw):  # noqa: N802 (subprocess's name)
    """subprocess.Popen, warm where it can be."""
    args = [str(a) for a in args]
    if args[:3] != [sys.executable, "-m", "retrain"]:
        return subprocess.Popen(args, **kw)
    env = dict(os.environ if kw.get("env") is None else kw["env"])
    zygote = None if set(kw) - SUPPORTED else _zygote_for(env)
    if zygote is not None:
        try:
            proc = WarmProcess(args, zygote, **{**kw, "env": env})
            COUNTS["forked"] += 1
            return proc
        except (ConnectionError, FileNotFoundError):   # that zygote is gone: start cold
            _zygotes.pop(_signature(env), None)
    COUNTS["cold"] += 1
    return subprocess.Popen(args, **kw)


def run(args, *, input=None, capture_output=False, timeout=None, check=False, **kw):
    """subprocess.run over `Popen`."""
    if capture_output:
        kw["stdout"] = kw["stderr"] = subprocess.PIPE
    if input is not None:
        kw["stdin"] = subprocess.PIPE
    with Popen(args, **kw) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    done = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def _import_time(env) -> dict[str, str]:
    found = {k: v for k, v in env.items() if k.startswith(IMPORT_TIME) and k not in HANDLED}
    if "PYTHONPATH" in found:   # "REPO", "REPO:" and "REPO:REPO" put the same folders on sys.path
        folders = found["PYTHONPATH"].split(os.pathsep)
        found["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(f for f in folders if f))
    return found


def _signature(env) -> tuple:
    return tuple(sorted(_import_time(env).items()))


@dataclass
class Zygote:
    path: str          # its socket
    pid: int | None    # None in a warm child, whose zygote another process started


_zygotes: dict[tuple, Zygote] = {}   # by the import-time variables they were started with
_owner = [0]                         # the process those belong to (not a fork of it)


def _zygote_for(env: dict) -> Zygote | None:
    """The zygote for `env`, or None (start cold). A test process starts zygotes only for the
    environment its tests' subprocesses get (conftest.subprocess_env's: its own plus the
    checkout on PYTHONPATH), at most MAX_ZYGOTES as that changes; a one-off environment (a
    test's own cache folders, thread counts) starts cold, which costs what a zygote would.
    A warm child (a campaign runner) uses its own zygote for what matches it."""
    if _owner[0] != os.getpid():
        _zygotes.clear()
        _owner[0] = os.getpid()
    key = _signature(env)
    if key not in _zygotes:
        inherited = os.environ.get(SOCKET_ENV)
        if inherited:
            if key != _signature(os.environ):
                return None
            _zygotes[key] = Zygote(inherited, None)
        elif key == _signature(_tests_env()) and len(_zygotes) < MAX_ZYGOTES:
            _zygotes[key] = _start(env)
        else:
            return None
    return _zygotes[key]


def _tests_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _start(env: dict) -> Zygote:
    folder = tempfile.mkdtemp(prefix="retrain-zygote-")
    path = os.path.join(folder, "zygote.sock")
    proc = subprocess.Popen([sys.executable, str(ZYGOTE), path, str(os.getpid()), "x" * 16384],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, cwd=folder)
    ready = select.select([proc.stdout], [], [], ZYGOTE_START_S)[0] and proc.stdout.readline()
    if not ready or ready.strip() != b"ready":
        proc.kill()
        raise RuntimeError(f"the warm zygote did not start within {ZYGOTE_START_S:g} s (exit "
                           f"{proc.wait()}); its error is above, in the pytest worker's output")
    atexit.register(shutil.rmtree, folder, True)
    atexit.register(proc.kill)   # runs first
    COUNTS["zygotes"] += 1
    return Zygote(path, proc.pid)


class _Subprocess:
    """The subprocess module with a warm Popen: what a warm campaign runner launches with."""

    Popen = staticmethod(Popen)

    def __getattr__(self, name: str):
        return getattr(subprocess, name)


SUBPROCESS = _Subprocess()


class WarmProcess:
    """A child of the zygote with the parts of subprocess.Popen's interface the tests use."""

    def __init__(self, args: list[str], zygote: Zygote, *, env: dict, cwd=None, stdin=None,
                 stdout=None, stderr=None, text=None, universal_newlines=None, encoding=None,
                 errors=None, start_new_session=False, bufsize=-1):
        self.args, self.returncode, self.zygote_pid = args, None, zygote.pid
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(zygote.path)
        except OSError:
            self._conn.close()
            raise
        text_mode = bool(text or universal_newlines or encoding or errors)
        opened: list[int] = []   # the child's ends, closed here once the zygote has its copies
        child_fds: list[int] = []
        for fd, spec, mode in ((0, stdin, "w"), (1, stdout, "r"), (2, stderr, "r")):
            child_fd, mine = self._descriptor(fd, spec, mode, child_fds, opened)
            child_fds.append(child_fd)
            stream = None if mine is None else _stream(mine, mode, text_mode, encoding, errors)
            setattr(self, ("stdin", "stdout", "stderr")[fd], stream)
        job = {"argv": args, "cwd": str(cwd or os.getcwd()),
               "env": {**env, SOCKET_ENV: zygote.path}, "new_session": bool(start_new_session)}
        socket.send_fds(self._conn, [json.dumps(job).encode() + b"\n"], child_fds)
        for fd in opened:
            os.close(fd)
        self._buffer = b""
        self.pid = self._message(None)["pid"]

    @staticmethod
    def _descriptor(fd: int, spec, mode: str, earlier: list[int], opened: list[int]):
        """(the descriptor the child gets, our end of a new pipe or None)."""
        if spec == subprocess.PIPE:
            read, write = os.pipe()
            child, mine = (read, write) if mode == "w" else (write, read)
            opened.append(child)
            return child, mine
        if spec == subprocess.DEVNULL:
            child = os.open(os.devnull, os.O_RDWR)
            opened.append(child)
            return child, None
        if spec == subprocess.STDOUT:
            return earlier[1], None
        if spec is None:
            return fd, None
        return (spec if isinstance(spec, int) else spec.fileno()), None

    def _message(self, timeout: float | None) -> dict | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            chunk = self._conn.recv(4096)
            if not chunk:
                raise RuntimeError(f"the warm zygote went away while {self.args} ran")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        if self.returncode is None:
            self._ended(self._message(0))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._ended(self._message(timeout)):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _ended(self, message: dict | None) -> bool:
        if message is None:
            return False
        self.returncode = os.waitstatus_to_exitcode(message["status"])
        CPU_S[0] += message["cpu_s"]
        self._conn.close()
        return True

    def communicate(self, input=None, timeout: float | None = None):
        return _communicate(self, input, timeout)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def _stream(fd: int, mode: str, text_mode: bool, encoding, errors):
    """Our end of a pipe to the child, as subprocess opens it (unbuffered writes)."""
    raw = os.fdopen(fd, mode + "b", buffering=0 if mode == "w" else -1)
    if not text_mode:
        return raw
    return io.TextIOWrapper(raw, encoding=encoding or "utf-8", errors=errors or "strict",
                            write_through=mode == "w")


def _communicate(proc: WarmProcess, input, timeout: float | None):
    """Write `input`, read both output pipes to their end, wait: as subprocess does."""
    results: dict[str, object] = {}

    def drain(name: str) -> None:
        results[name] = getattr(proc, name).read()

    readers = [threading.Thread(target=drain, args=(name,), daemon=True)
               for name in ("stdout", "stderr") if getattr(proc, name) is not None]
    for reader in readers:
        reader.start()
    if proc.stdin is not None:
        if input:
            proc.stdin.write(input)
        proc.stdin.close()
    deadline = None if timeout is None else time.monotonic() + timeout
    for reader in readers:
        reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if reader.is_alive():
            raise subprocess.TimeoutExpired(proc.args, timeout)
    proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return results.get("stdout"), results.get("stderr")

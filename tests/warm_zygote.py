"""A warm interpreter for the suite's `python -m retrain ...` processes (see tests/warm.py).

Started once per pytest worker as `python tests/warm_zygote.py SOCKET PARENT_PID PADDING`, it
imports what a run, a campaign runner and `retrain serve` import (torch, transformers, peft, the
tinker SDK, uvicorn: ~5 CPU-seconds a fresh process pays), then forks one child per request. A
child takes the request's working folder, environment, standard streams, session and command
line (/proc/PID/cmdline reads as the command asked for, so a campaign's adoption check that reads
it still works), then runs `retrain/__main__.py` as `python -m retrain` would and exits through
the interpreter's normal shutdown. The zygote reports each child's exit status and CPU seconds on
the request's connection. PADDING is room in the argument area for the children's command lines.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import runpy
import selectors
import signal
import socket
import sys
from dataclasses import dataclass, field

import warm  # tests/warm.py: this file's folder is sys.path[0]

PRELOAD = (  # what the children would otherwise import themselves, each time
    "retrain.cli.app", "retrain.cli.launch", "retrain.run.single", "retrain.campaign.runner",
    "retrain.backends.local.backend", "retrain.backends.tinker.backend", "retrain.serve.server",
    "transformers.models.llama.modeling_llama", "transformers.models.llama.configuration_llama",
    "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
    "peft",
)


def preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request: a JSON line sent with the child's three standard streams' descriptors."""
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            raise EOFError("the request was cut short")
        data += more
    return json.loads(data), fds


@dataclass
class Children:
    """The zygote's children: each one's connection, the test-started child it was started
    for (a campaign runner's workers count toward the runner), and CPU that counts toward it."""

    conns: dict[int, socket.socket] = field(default_factory=dict)
    root: dict[int, int] = field(default_factory=dict)
    cpu_s: dict[int, float] = field(default_factory=dict)


def serve(listener: socket.socket, parent: int) -> tuple[dict, list[int]]:
    """Fork a child per request and report how each ends; returns only in a child."""
    children = Children()
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    while os.getppid() == parent:
        for _key, _events in selector.select(timeout=0.02):
            conn, _ = listener.accept()
            try:
                job, fds = receive(conn)
            except (OSError, EOFError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                selector.close()
                listener.close()
                for other in (conn, *children.conns.values()):
                    other.close()
                job["env"].setdefault(warm.ROOT_ENV, str(os.getpid()))
                return job, fds
            for fd in fds:
                os.close(fd)
            _send(conn, {"pid": pid})
            children.conns[pid] = conn
            children.root[pid] = int(job["env"].get(warm.ROOT_ENV, pid))
        _reap(children)
    os._exit(0)  # the pytest worker is gone; children already started run on


def _reap(children: Children) -> None:
    """Report each ended child: its exit status and CPU seconds, with those of the children
    started for it that ended before it."""
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        cpu_s = usage.ru_utime + usage.ru_stime
        root = children.root.pop(pid, pid)
        if root != pid:
            children.cpu_s[root] = children.cpu_s.get(root, 0.0) + cpu_s
        conn = children.conns.pop(pid, None)
        if conn is not None:
            cpu_s += children.cpu_s.pop(pid, 0.0) if root == pid else 0.0
            _send(conn, {"status": status, "cpu_s": cpu_s})
            conn.close()


def _send(conn: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):   # the test no longer listens
        conn.sendall(json.dumps(message).encode() + b"\n")


def become(job: dict, fds: list[int]) -> None:
    """In the child: take the request's process attributes, then run `python -m retrain`."""
    if job["new_session"]:
        os.setsid()
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)
    _fresh_stdio(job["env"].get("PYTHONUNBUFFERED", "") != "")
    set_cmdline(job["argv"])
    import retrain.campaign.executor

    retrain.campaign.executor.subprocess = warm.SUBPROCESS   # a campaign's workers: warm too
    sys.argv = ["-m", *job["argv"][3:]]   # runpy puts retrain/__main__.py in front, as -m does
    sys.path[0] = job["cwd"]               # as -m does
    exit_like_python(lambda: runpy.run_module("retrain", run_name="__main__", alter_sys=True))


def exit_like_python(main) -> None:
    """Run `main`, then end as the interpreter does, in the parts a test can see: the exit
    status, the traceback of an uncaught exception, joined threads, atexit handlers, flushed
    streams. Not the teardown of every module's objects, which Python does not promise either:
    in a fork that touches, and so copies, every page of the zygote's heap (1.8 CPU-s)."""
    import atexit
    import threading
    import traceback

    status, interrupted = 0, False
    try:
        main()
    except SystemExit as exc:
        status = _exit_status(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:  # noqa: BLE001 (the child's last word, as Python prints it)
        traceback.print_exc()
        status = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if interrupted:   # as CPython ends on an uncaught KeyboardInterrupt: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _fresh_stdio(unbuffered: bool) -> None:
    """Standard streams over the new descriptors, as a fresh interpreter makes them."""
    encoding = sys.stdout.encoding
    sys.stdin = sys.__stdin__ = open(0, encoding=encoding, closefd=False)  # noqa: SIM115
    for fd, name, errors in ((1, "stdout", "strict"), (2, "stderr", "backslashreplace")):
        stream = open(fd, "w", encoding=encoding, errors=errors, closefd=False)  # noqa: SIM115
        stream.reconfigure(line_buffering=fd == 2 or os.isatty(fd), write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def set_cmdline(argv: list[str]) -> None:
    """Write `argv` over this process's argument area, where /proc/PID/cmdline reads it."""
    with open("/proc/self/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    start, end = int(fields[48 - 3]), int(fields[49 - 3])   # arg_start and arg_end: fields 48, 49
    text = b"\0".join(a.encode() for a in argv) + b"\0"
    if len(text) > end - start:
        raise SystemExit(f"warm zygote: command line longer than its {end - start} bytes")
    ctypes.memmove(start, text.ljust(end - start, b"\0"), end - start)


def main() -> None:
    path, parent = sys.argv[1], int(sys.argv[2])
    preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    job, fds = serve(listener, parent)
    become(job, fds)


if __name__ == "__main__":
    main()

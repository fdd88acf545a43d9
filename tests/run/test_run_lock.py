"""One process per run folder (retrain/run/run_lock.py): the refusal names the holder's pid,
also when it races the holder's start (seen in the suite: two `retrain run.toml` started
together, and the refusal read the lock file before the winner had written its pid)."""

from __future__ import annotations

import fcntl
import os
import threading
import time

import pytest

from retrain.errors import UserError
from retrain.run import run_lock


def _start(run_dir) -> None:
    """A second start on the folder: take the lock, train nothing."""
    with run_lock.hold(run_dir):
        pass


def test_the_holder_writes_its_pid_and_a_second_start_is_refused_naming_it(tmp_path):
    run_dir = tmp_path / "logs" / "run"
    with run_lock.hold(run_dir):
        assert run_lock.lock_path(run_dir).read_text() == f"{os.getpid()}\n"
        with pytest.raises(UserError, match=rf"being trained by another process \(pid "
                                            rf"{os.getpid()}\); stop it first"):
            _start(run_dir)
    _start(run_dir)  # released: the next start takes it


def _lock_without_pid(run_dir) -> int:
    """The holder's state between its flock and the write of its pid."""
    path = run_lock.lock_path(run_dir)
    path.parent.mkdir(parents=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_a_start_racing_the_holder_still_names_its_pid(tmp_path):
    run_dir = tmp_path / "logs" / "run"
    fd = _lock_without_pid(run_dir)
    writer = threading.Timer(0.2, lambda: os.pwrite(fd, b"4242\n", 0))
    writer.start()
    try:
        with pytest.raises(UserError, match=r"another process \(pid 4242\)"):
            _start(run_dir)
    finally:
        writer.join()
        os.close(fd)


def test_a_holder_that_never_writes_its_pid_is_refused_without_one(tmp_path):
    run_dir = tmp_path / "logs" / "run"
    fd = _lock_without_pid(run_dir)
    try:
        started = time.monotonic()
        with pytest.raises(UserError, match=r"another process; stop it first"):
            _start(run_dir)
        assert time.monotonic() - started < 5  # it waits about a second, not forever
    finally:
        os.close(fd)

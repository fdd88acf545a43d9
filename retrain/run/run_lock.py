"""One process per single-run folder: an exclusive flock on `<log_dir>/.<run>.lock`.

The lock sits beside the run folder, not in it, so `--new` (which moves the folder aside)
cannot hand a second process a fresh, unlocked folder. The kernel drops a flock when its
process ends, however it ends, so a SIGKILLed run never blocks the next start. Campaign
folders have their own (runner) lock; their runs take this one as well.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from retrain.errors import UserError


def lock_path(run_dir: Path) -> Path:
    return run_dir.parent / f".{run_dir.name}.lock"


@contextmanager
def hold(run_dir: Path) -> Iterator[None]:
    """Hold the run folder's lock, or raise UserError naming the process that holds it. A
    log folder that cannot be created is left to `checkpoint.ensure_writable` to report."""
    path = lock_path(run_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            raise UserError(f"{run_dir} is being trained by another process{holder}; stop it "
                            "first (Ctrl-C or kill it), wait for it, or pick another "
                            "logging.run_name") from None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def _holder(fd: int, wait_s: float = 1.0) -> str:
    """" (pid N)" of the holder. It writes its pid just after taking the lock, so a start that
    races it may find the file still empty: read again for up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(OSError, ValueError):
            pid = int(os.pread(fd, 32, 0).decode().strip())
            return f" (pid {pid})"
        if time.monotonic() >= deadline:
            return ""
        time.sleep(0.02)

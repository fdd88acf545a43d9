"""SIGINT/SIGTERM during a run: finish the step in flight (first), abandon it (second)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Any


class StopRequest:
    """SIGINT/SIGTERM: the first finishes the step in flight, a second abandons it."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        print("\nstopping after the current step (press Ctrl-C again to stop now)",
              file=sys.stderr, flush=True)

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)


def exit_quietly_on_interrupt() -> None:
    """Until a command installs its own handler (the trainer's StopRequest, the campaign
    runner, serve): Ctrl-C ends the process at once with status 130 and one line.

    A KeyboardInterrupt raised inside `import torch` or transformers' lazy imports leaves
    half-imported modules behind (the next access fails with a long chained traceback) or
    aborts in C++; nothing worth cleaning up exists before training starts, so exit."""
    import os

    def handler(_signum: int, _frame: Any) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a stream mid-write or closed: exit anyway
                stream.flush()
        with contextlib.suppress(OSError):
            os.write(2, b"interrupted\n")
        os._exit(128 + signal.SIGINT)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, handler)

"""SIGINT/SIGTERM during a run: finish the step in flight (first), abandon it (second)."""

from __future__ import annotations

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

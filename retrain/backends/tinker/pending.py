"""Tinker requests still in flight, as the trainer sees them: a loss whose numbers are fetched
on first use, and a batch of sampling requests."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

from retrain.backends.base import Completion, LossOutput


class PendingLoss(LossOutput):
    """A submitted forward_backward; its numbers are fetched on first access."""

    def __init__(self, resolve: Callable[[], LossOutput], submitted: threading.Event):
        self._resolve = resolve
        self.submitted = submitted  # set once the request is on its way
        self._value: LossOutput | None = None
        self._lock = threading.Lock()

    def get(self) -> LossOutput:
        with self._lock:
            if self._value is None:
                self._value = self._resolve()
            return self._value

    loss = property(lambda self: self.get().loss)                # type: ignore[assignment]
    logprobs = property(lambda self: self.get().logprobs)        # type: ignore[assignment]
    metrics = property(lambda self: self.get().metrics)          # type: ignore[assignment]


class SampleJob:
    """Sampling requests in flight; `result()` waits for all of them (prompt order kept)."""

    def __init__(self, futures: list[concurrent.futures.Future]):
        self._futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def result(self) -> list[list[Completion]]:
        return [f.result() for f in self._futures]

    def cancel(self) -> None:
        for f in self._futures:
            f.cancel()

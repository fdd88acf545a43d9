"""The sampling client of the current weights on a Tinker service: saved right behind each
optimizer step (save_weights_for_sampler) and read only when the next sample needs it, so the
save's round trips overlap whatever the trainer does in between."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

from retrain.backends.base import finished
from retrain.backends.tinker.calls import TinkerCalls


class CurrentSampler:
    """The sampler of the current weights, or the save in flight that will give it."""

    def __init__(self, calls: TinkerCalls, training: Callable[[], Any]):
        self._calls = calls
        self._training = training  # the training client, created on first use
        self._sampler: Any = None
        self._next: tuple[concurrent.futures.Future, threading.Event] | None = None

    def refresh(self) -> None:
        """Save the sampler now and wait for it."""
        tc = self._training()  # (created outside the slot: never hold one while taking another)
        self._next = None
        self._sampler = self._calls.call("save_weights_for_sampler",
                                         tc.save_weights_and_get_sampling_client)

    def queue_refresh(self, tc: Any) -> None:
        """Save the sampler of the new weights right behind the optimizer step (the SDK keeps
        the order); it is read only when the next sample needs it."""
        sent = threading.Event()
        job = self._calls.pool.submit(self._calls.call, "save_weights_for_sampler",
                                      tc.save_weights_and_get_sampling_client, submitted=sent)
        self._next = (job, sent)

    def wait_sent(self) -> None:
        """Wait until a queued save is sent, to keep it ahead of the next request in the
        SDK's order."""
        if self._next is not None:
            self._next[1].wait()

    def current(self) -> Any:
        if self._next is not None:
            job, self._next = self._next[0], None
            self._sampler = job.result()
        if self._sampler is None:
            self.refresh()
        return self._sampler

    def job(self) -> concurrent.futures.Future:
        """The sampler of the current weights, as a future: its save may still be in flight."""
        if self._next is not None:
            return self._next[0]
        return finished(self.current)

"""Checkpoints on a Tinker service: save_state and load_state (weights + optimizer), and the
superseded step checkpoints deleted there, as the trainer prunes its own folder."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any

from retrain.backends.base import BackendError
from retrain.backends.tinker.calls import TinkerCalls
from retrain.runfiles import runlog

log = logging.getLogger("retrain.tinker")


class ServiceCheckpoints:
    """The step checkpoints this backend saved on the service, oldest first."""

    def __init__(self, calls: TinkerCalls, *, keep_every: int, final_step: int | None):
        self._calls = calls
        self._keep_every = keep_every
        self._final_step = final_step
        self._saved: list[tuple[str, str]] = []  # (name, tinker path), oldest first
        self._saved_lock = threading.Lock()      # appended to by the thread of each save
        self._deletions: list[concurrent.futures.Future] = []
        self._rest: Any = None
        self._rest_lock = threading.Lock()  # one RestClient, not one per concurrent deletion

    def save_async(self, tc: Any, name: str) -> concurrent.futures.Future[str]:
        """Submit the save on training client `tc` now; the future gives its tinker:// path."""
        job = self._calls.submit_in_order("save_state",
                                          lambda: tc.save_state(name, overwrite=True))
        return self._calls.pool.submit(self._record, name, job)

    def load(self, ref: str) -> Any:
        """A new training client with the weights + optimizer of save_state path `ref`."""
        service = self._calls.service
        return self._calls.call(
            "load_state", lambda: service.create_training_client_from_state_with_optimizer(ref),
            queue_on_429=True)

    def wait_deletions(self, timeout_s: float) -> None:
        concurrent.futures.wait(self._deletions, timeout=timeout_s)

    def _record(self, name: str, job: concurrent.futures.Future) -> str:
        path = job.result().path
        with self._saved_lock:
            self._saved.append((name, path))
            self._prune()
        return path

    def _prune(self) -> None:
        """Delete superseded step checkpoints on the service, like the trainer prunes its
        folder: keep every `save_every`-th, the final one, and always the newest two (the
        run's state.json names the newest only once it is written)."""
        if self._final_step is None:  # not told the run's plan: keep everything
            return
        for entry in self._saved[:-2]:
            step = runlog.checkpoint_step(entry[0])
            if step is not None and not self._keeps(step):
                self._saved.remove(entry)
                self._deletions.append(self._calls.pool.submit(self._delete, entry[1]))

    def _keeps(self, step: int) -> bool:
        return step == self._final_step or bool(self._keep_every and step % self._keep_every == 0)

    def _delete(self, path: str) -> None:
        """Best effort: a checkpoint that cannot be deleted only costs storage."""
        calls = self._calls

        def submit() -> Any:  # inside the slot: creating the client sends requests too
            with self._rest_lock:
                if self._rest is None:
                    self._rest = calls.tinker.RestClient(base_url=calls.base_url)
            return self._rest.delete_checkpoint_from_tinker_path(path)

        try:
            calls.call("delete_checkpoint", submit, fatal_timeout=False)
        except BackendError as exc:
            log.warning("%s (checkpoint %s kept)", exc, path)

"""API requests to a Tinker service: the SDK's ServiceClient and the threads that talk to it,
each request holding an API slot only while it is on the wire, waited for within
`backend.request_timeout_s`, a 429 on a new training client queued, and every failure turned
into a BackendError with the API key scrubbed."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from retrain.backends.base import BackendError
from retrain.backends.tinker import slot_lease
from retrain.backends.tinker.overload import HTTP_LOGGER, watch_overload
from retrain.backends.tinker.rate_limit import (
    QUEUES_429_HEADER,
    RateLimited,
    RateLimitWait,
    is_rate_limited,
    retry_after_s,
    stop_sdk_retrying_429,
)
from retrain.backends.tinker.sdk import KEY_ENV, Secret
from retrain.slots.file_slots import ApiSlots, NoSlots

SAMPLE_THREADS = 32


class TinkerCalls:
    """The service client of one backend and the requests it sends (one `call` each)."""

    def __init__(self, tinker: Any, *, base_url: str | None, secret: Secret, timeout_s: float,
                 slots: ApiSlots):
        self.tinker = tinker
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.slots = slots
        self._secret = secret
        self._overload = None if isinstance(slots, NoSlots) else \
            watch_overload(slots.record_error)  # a campaign: its controller counts them
        self._keepers = None  # threads that hold slots for calls (slot_lease)
        if not isinstance(slots, NoSlots):
            slot_lease.install()  # before the ServiceClient makes its HTTP clients
            self._keepers = concurrent.futures.ThreadPoolExecutor(
                2 * SAMPLE_THREADS + 2, thread_name_prefix="tinker-slot")
        self.service = tinker.ServiceClient(base_url=base_url, default_headers_overrides={
            QUEUES_429_HEADER: "1"})  # retrain serve: no SDK retries of its 429s (we queue)
        self.pool = concurrent.futures.ThreadPoolExecutor(SAMPLE_THREADS,
                                                          thread_name_prefix="tinker-call")
        # Sampling has its own threads, so a batch sampled during training (off-policy
        # overlap) never delays the training requests queued behind it.
        self.sample_pool = concurrent.futures.ThreadPoolExecutor(
            SAMPLE_THREADS, thread_name_prefix="tinker-sample")
        self.broken: str | None = None  # the request whose timeout left the client stuck
        self.rate_limit_wait_s = 0.0  # time spent waiting out 429s (part of api_wait_s)
        self._wait_lock = threading.Lock()

    def fail(self, what: str, exc: BaseException) -> BackendError:
        """The BackendError for a failed request: what to do about it, the key scrubbed."""
        tinker = self.tinker
        if isinstance(exc, TimeoutError):
            hint = (f"no answer within backend.request_timeout_s = {self.timeout_s:g} s; the "
                    "run stops here and resumes from its last checkpoint when started again")
        elif isinstance(exc, tinker.AuthenticationError):
            hint = f"the service rejected the API key; check ${KEY_ENV}"
        elif isinstance(exc, tinker.APIConnectionError):
            hint = f"cannot reach {self.base_url or 'the Tinker service'}; is it up?"
        else:
            hint = f"{type(exc).__name__}: {exc}"
        return BackendError(self._secret.scrub(f"tinker {what} failed: {hint}"))

    def _wait(self, what: str, future: Any, lease: slot_lease.SlotLease | None, *,
              fatal_timeout: bool = True, queue_on_429: bool = False) -> Any:
        """The future's result within the deadline, or a BackendError (never a raw SDK error).
        Time the call spent waiting for a slot again (after an overload answer) does not count
        against the deadline, as the wait for its first slot does not."""
        try:
            return _result_within(future, self.timeout_s, lease)
        except BaseException as exc:
            if queue_on_429 and is_rate_limited(exc):
                raise RateLimited(str(exc), retry_after_s(exc)) from None
            if isinstance(exc, TimeoutError):
                future.future().cancel()
                if fatal_timeout:  # the training client is stuck behind this request
                    self.broken = what
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise self.fail(what, exc) from None

    def call(self, what: str, submit: Callable[[], Any], *, fatal_timeout: bool = True,
             submitted: threading.Event | None = None, queue_on_429: bool = False) -> Any:
        """One API request: submit, wait for the result, holding a slot while it is in flight.

        With slots shared by a campaign, the slot is held only while one of the call's HTTP
        requests is on the wire (`slot_lease`): when the SDK backs off an overload
        answer before sending again, it sleeps with the slot given back. With `queue_on_429`
        (requests that open a new training client, safe to send again), the SDK does not
        retry a 429 at all: the backend waits out a backoff itself and asks again, for as long
        as the service keeps answering 429: queued, not failed.
        """
        waiting = RateLimitWait(what)
        while True:
            self.check_usable()
            with self._lease() as lease:
                try:
                    if queue_on_429:
                        stop_sdk_retrying_429(self.service)
                    future = submit()
                except Exception as exc:
                    if not (queue_on_429 and is_rate_limited(exc)):
                        raise self.fail(what, exc) from None
                    future, reason, asked = None, str(exc), retry_after_s(exc)
                finally:
                    if submitted is not None:
                        submitted.set()
                if future is not None:
                    try:
                        return self._wait(what, future, lease, fatal_timeout=fatal_timeout,
                                          queue_on_429=queue_on_429)
                    except RateLimited as exc:
                        reason, asked = str(exc), exc.retry_after
            # the slot is free again while we sleep: other workers' requests go meanwhile
            slept = waiting.sleep(self._secret.scrub(reason), asked)
            with self._wait_lock:
                self.rate_limit_wait_s += slept

    @contextlib.contextmanager
    def _lease(self) -> Iterator[slot_lease.SlotLease | None]:
        """The slot of one call: a lease that holds it only while a request is on the wire;
        for a standalone run (no slots to share), nothing."""
        if self._keepers is None:
            yield None
            return
        lease = slot_lease.SlotLease(self.slots, self._keepers)
        token = slot_lease.CURRENT.set(lease)
        try:
            yield lease
        finally:
            slot_lease.CURRENT.reset(token)
            lease.close()

    def submit_in_order(self, what: str, submit: Callable[[], Any]) -> concurrent.futures.Future:
        """`call` in a worker thread; returns once the request is sent (or has failed), so the
        training client's next request is numbered after it."""
        sent = threading.Event()

        def run() -> Any:
            try:
                return self.call(what, submit, submitted=sent)
            finally:
                sent.set()  # also when the call failed before sending anything

        job = self.pool.submit(run)
        sent.wait()
        return job

    def check_usable(self) -> None:
        if self.broken:
            raise BackendError(f"tinker {self.broken} timed out earlier, so this training "
                               "client cannot continue; the run resumes from its last "
                               "checkpoint when started again")

    def close(self) -> None:
        """Finish the session (best effort) and stop the worker threads."""
        try:
            with self.slots:
                self.service.close("success").result(timeout=min(self.timeout_s, 30))
        except Exception:  # closing is best effort: the service times the session out
            pass
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.sample_pool.shutdown(wait=False, cancel_futures=True)
        if self._keepers is not None:
            self._keepers.shutdown(wait=False)
        if self._overload is not None:
            logging.getLogger(HTTP_LOGGER).removeFilter(self._overload)


def _result_within(future: Any, timeout_s: float, lease: slot_lease.SlotLease | None) -> Any:
    """`future.result()`, or TimeoutError once `timeout_s` pass, not counting the time the
    lease spent waiting for slots meanwhile."""
    start = time.monotonic()
    while True:
        waited = lease.waited_s() if lease is not None else 0.0
        left = start + timeout_s + waited - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no result within {timeout_s:g} s")
        try:
            return future.result(timeout=left)
        except TimeoutError:
            if lease is None or lease.waited_s() == waited:
                raise

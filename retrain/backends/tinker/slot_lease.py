"""One backend call's API slot, held only while the call has a request on the wire.

The tinker SDK retries an overloaded request itself, in up to three loops (the HTTP client's,
`execute_with_retries`, the result polling), and sleeps between the tries. Training requests
must be sent again by the SDK, under the seq_id they were numbered with, so the SDK keeps its
retries and the slot moves instead:

- A call (`TinkerBackend._call`) opens a `SlotLease` and submits its SDK request in the
  lease's context (a ContextVar; the SDK's coroutines inherit it).
- Each HTTP request the SDK sends for the call (a first send, a re-send, a poll for the
  result) first takes the call's slot if it has none (`before_send`).
- An answer of 429/502/503/504, or no answer at all, gives the slot back before the SDK
  sees it (`after_send`), when none of the call's other requests is in flight: the SDK then
  sleeps slot-free, and its re-send waits for a slot like any new request.
- The call's end gives back whatever it still holds.

The slot semaphores are per thread (`with slots:` on one thread), and the SDK's coroutines
all run on one event loop, so each hold lives on a keeper thread of its own (`_Hold`), which
takes the slot, waits for the word to give it back, and does. Keeper threads run in the
context of the request that asked for the slot.

Housekeeping requests the SDK sends from background loops (heartbeats, telemetry, its
config refresh) are not calls: they never take a slot. Standalone runs (`NoSlots`) do not use
leases at all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
import time
from typing import Any

from retrain.slots.semaphore import OVERLOAD_CODES

CURRENT: contextvars.ContextVar[SlotLease | None] = contextvars.ContextVar(
    "retrain_slot_lease", default=None)
HOUSEKEEPING = ("/session_heartbeat", "/telemetry", "/client/dynamic_config")

_installed = False
_install_lock = threading.Lock()


class _Hold:
    """One slot, taken and given back by one keeper thread (the semaphores are per thread)."""

    def __init__(self, slots: Any, keepers: concurrent.futures.Executor,
                 context: contextvars.Context):
        self._slots = slots
        self.taken: concurrent.futures.Future = concurrent.futures.Future()
        self.released: concurrent.futures.Future = concurrent.futures.Future()
        self._give_back = threading.Event()
        keepers.submit(context.run, self._keep)

    def _keep(self) -> None:
        try:
            self._slots.__enter__()
        except BaseException as exc:  # a timeout, a lost cluster: the request fails with it
            _settle(self.taken, exc=exc)
            _settle(self.released, None)
            return
        if _settle(self.taken, None):
            self._give_back.wait()
        try:
            self._slots.__exit__(None, None, None)
        finally:
            _settle(self.released, None)

    def give_back(self) -> concurrent.futures.Future:
        """Give the slot back (once it is taken); the future is done when it is."""
        self._give_back.set()
        self.taken.cancel()  # not taken yet: the keeper gives it back the moment it is
        return self.released


def _settle(future: concurrent.futures.Future, value: Any = None, *,
            exc: BaseException | None = None) -> bool:
    """Set a future's outcome unless it was cancelled; False if it was."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(value)
        return True
    except concurrent.futures.InvalidStateError:
        return False


class SlotLease:
    """The slot of one backend call; see the module's docstring."""

    def __init__(self, slots: Any, keepers: concurrent.futures.Executor):
        self._slots = slots
        self._keepers = keepers
        self._lock = threading.Lock()          # _hold and closed: the loop and the call's thread
        self._hold: _Hold | None = None
        self._taking: asyncio.Future | None = None   # event loop only from here down
        self._in_flight = 0
        self.closed = False
        self._waited_s = 0.0
        self._waiting_since: float | None = None

    def waited_s(self) -> float:
        """Seconds this call has spent waiting for slots after its first request went out
        (a wait in progress included): its request deadline does not count them."""
        since = self._waiting_since
        return self._waited_s + (time.monotonic() - since if since is not None else 0.0)

    async def before_send(self) -> None:
        """Hold the call's slot for one more request on the wire (taking it if needed)."""
        self._in_flight += 1
        try:
            while self._hold is None and not self.closed:
                if self._taking is None:
                    self._taking = asyncio.ensure_future(self._take())
                await asyncio.shield(self._taking)
        except BaseException:
            self._in_flight -= 1
            raise

    async def _take(self) -> None:
        hold = _Hold(self._slots, self._keepers, contextvars.copy_context())
        self._waiting_since = time.monotonic()
        try:
            await asyncio.wrap_future(hold.taken)
        except BaseException:
            hold.give_back()
            raise
        finally:
            self._waited_s += time.monotonic() - self._waiting_since
            self._waiting_since = None
            self._taking = None
        with self._lock:
            if not self.closed:
                self._hold, hold = hold, None
        if hold is not None:  # the call ended while its request waited: not needed any more
            hold.give_back()

    async def after_send(self, status: int | None) -> None:
        """One request is off the wire: answered `status`, or not answered (None). An
        overload answer or none gives the slot back, unless another request is in flight."""
        self._in_flight -= 1
        if self._in_flight or (status is not None and status not in OVERLOAD_CODES):
            return
        with self._lock:
            hold, self._hold = self._hold, None
        if hold is not None:
            await asyncio.wrap_future(hold.give_back())  # the SDK sleeps only once it is free

    def close(self) -> None:
        """The call is over: give back its slot (its SDK coroutines take none from now on)."""
        with self._lock:
            self.closed = True
            hold, self._hold = self._hold, None
        if hold is not None:
            hold.give_back().result()


def install() -> None:
    """Route every HTTP request of the tinker SDK's async clients through the lease of the
    call that sends it (a no-op outside calls). Idempotent; call before the ServiceClient is
    made, so that all its clients are covered."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from tinker._client import AsyncTinker

        original_init = AsyncTinker.__init__

        def init(self, *args: Any, **kwargs: Any) -> None:
            original_init(self, *args, **kwargs)
            _wrap_send(self._client)

        AsyncTinker.__init__ = init  # type: ignore[method-assign]
        _installed = True


def _wrap_send(http: Any) -> None:
    """Wrap one httpx.AsyncClient's `send` (once: SDK clients copied with new options share
    their httpx client)."""
    send = http.send
    if getattr(send, "_retrain_slot_lease", False):
        return

    async def leased_send(request: Any, *args: Any, **kwargs: Any) -> Any:
        lease = CURRENT.get()
        if lease is None or lease.closed or request.url.path.endswith(HOUSEKEEPING):
            return await send(request, *args, **kwargs)
        await lease.before_send()
        try:
            response = await send(request, *args, **kwargs)
        except BaseException:
            await lease.after_send(None)
            raise
        await lease.after_send(response.status_code)
        return response

    leased_send._retrain_slot_lease = True  # type: ignore[attr-defined]
    http.send = leased_send

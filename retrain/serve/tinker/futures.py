"""Request futures: every async op answers `{request_id}` at once; `retrieve_future` long-polls.

All methods run on the event loop thread, so no locks are needed. A poll waits up to
`hold_s` for the result (the SDK's poll timeout is 45 s and a `try_again` reply triggers
an instant re-poll, so holding the poll is what keeps clients from busy-polling). Results
are kept for `keep_s` after their first delivery, because a reply lost on the way back is
polled again with the same id. A live client always has a poll open on an unfinished
future (the SDK polls again at once), so one nobody polls for long has lost its client, and
one whose last poll's connection closed (the SDK never drops a held poll) has lost it now.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass, field


@dataclass
class Reply:
    """A finished future: protobuf bytes, a JSON object, or an error with its category."""

    proto: bytes | None = None
    json: dict | None = None
    error: str | None = None
    category: str = "server"  # "user" | "server"


@dataclass
class _Entry:
    done: asyncio.Event = field(default_factory=asyncio.Event)
    reply: Reply | None = None
    created: float = field(default_factory=time.monotonic)
    delivered: float | None = None
    polls: int = 0                # polls waiting on it now
    polled: float = field(default_factory=time.monotonic)  # when a poll last began or ended


class FutureStore:
    """request_id -> eventual Reply, with long-polling and expiry."""

    def __init__(self, hold_s: float = 30.0, keep_s: float = 600.0, max_age_s: float = 3600.0):
        self.hold_s = hold_s
        self.keep_s = keep_s
        self.max_age_s = max_age_s
        self._entries: dict[str, _Entry] = {}
        self._prefix = uuid.uuid4().hex[:8]
        self._counter = itertools.count(1)

    def create(self) -> str:
        """A new pending future; returns its request id."""
        self._expire()
        request_id = f"req-{self._prefix}-{next(self._counter)}"
        self._entries[request_id] = _Entry()
        return request_id

    def resolve(self, request_id: str, reply: Reply) -> None:
        entry = self._entries.get(request_id)
        if entry is not None and entry.reply is None:
            entry.reply = reply
            entry.done.set()

    def known(self, request_id: str) -> bool:
        return request_id in self._entries

    def pending(self) -> int:
        return sum(1 for e in self._entries.values() if e.reply is None)

    def polls(self, request_id: str) -> int:
        """Polls waiting on `request_id` now (0 when unknown)."""
        entry = self._entries.get(request_id)
        return entry.polls if entry is not None else 0

    def unpolled_s(self, request_id: str) -> float:
        """Seconds an unfinished future has gone without any poll open on it (0 while one
        is, or once it is finished or unknown)."""
        entry = self._entries.get(request_id)
        if entry is None or entry.reply is not None or entry.polls:
            return 0.0
        return time.monotonic() - entry.polled

    async def wait(self, request_id: str, timeout: float | None = None,
                   disconnected: asyncio.Future | None = None) -> Reply | None:
        """The reply, or None when `timeout` (default hold_s) passes or the client went away.

        Raises KeyError for an unknown (never created or expired) request id.
        """
        entry = self._entries[request_id]
        if entry.reply is None:
            waiter = asyncio.ensure_future(entry.done.wait())
            watch = [waiter] + ([disconnected] if disconnected is not None else [])
            entry.polls += 1
            try:
                await asyncio.wait(watch, timeout=self.hold_s if timeout is None else timeout,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                entry.polls -= 1
                entry.polled = time.monotonic()
        if entry.reply is not None and entry.delivered is None:
            entry.delivered = time.monotonic()
        return entry.reply

    def _expire(self) -> None:
        now = time.monotonic()
        stale = [rid for rid, e in self._entries.items()
                 if (e.delivered is not None and now - e.delivered > self.keep_s)
                 or (e.reply is not None and now - e.created > self.max_age_s)]
        for rid in stale:
            del self._entries[rid]

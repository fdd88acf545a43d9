"""What the two slot semaphores share: `with sem:` takes one slot for this thread or times out,
and the usage meter every worker reports through its slots.

`slots.CountingSemaphore` (files, one machine) and `slots_ray.RaySlots` (a Ray actor, many
machines) differ only in how a slot is taken and given back, and in where the meter's counts
go (a file per worker process; the actor). It lives on its own so that `slots_ray` need not
import `slots`, which imports it lazily.

The meter is what the campaign's concurrency controller (`max_concurrent = "auto"`) reads:
calls made, completions and tokens served, overload answers (429/502/503/504) and slot-seconds
held, whose rate is the mean number of calls in flight (Little's law).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, fields
from typing import Self

OVERLOAD_CODES = (429, 502, 503, 504)


@dataclass
class Usage:
    """Cumulative API usage (of one worker, or summed over a campaign)."""

    calls: int = 0          # calls made (slots given back; the Ray actor: slots granted)
    completions: int = 0    # sequences sampled
    tokens: int = 0         # tokens sampled
    errors: int = 0         # overload answers: 429/502/503/504, retried or not
    held_s: float = 0.0     # slot-seconds held (in flight)

    def __add__(self, other: Usage) -> Usage:
        return Usage(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: Usage) -> Usage:
        return Usage(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: object) -> Usage:
        """A usage from JSON; anything malformed counts as nothing."""
        if not isinstance(d, dict):
            return cls()
        out = cls()
        for f in fields(cls):
            v = d.get(f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
                setattr(out, f.name, type(getattr(out, f.name))(v))
        return out


class SlotSemaphore(ABC):
    """At most `max_concurrent` holders; each thread holds at most one slot at a time.

    `wait_s` is the total time spent waiting to acquire, across threads; `where` names the
    shared place in messages (a folder, a Ray actor). Subclasses call `_meter_init()` in their
    constructor, `_held_from()` when a slot is taken and `_held_until()` when it is given back;
    `_publish()` is where the meter's counts go.
    """

    timeout: float | None
    wait_s: float

    @property
    @abstractmethod
    def where(self) -> str: ...

    @abstractmethod
    def acquire(self, timeout: float | None = None) -> bool:
        """Take a slot; False if `timeout` seconds pass first (None waits for ever)."""

    @abstractmethod
    def release(self) -> None:
        """Give back this thread's slot."""

    def not_reentrant(self) -> RuntimeError:
        return RuntimeError(f"this thread already holds a slot of {self.where}; "
                            "release it first (the semaphore is not reentrant)")

    def not_held(self) -> RuntimeError:
        return RuntimeError(f"this thread holds no slot of {self.where}")

    def __enter__(self) -> Self:
        if not self.acquire(self.timeout):
            raise TimeoutError(f"no API slot free in {self.where} after {self.timeout}s")
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # ------------------------------------------------------------------ the usage meter

    def _meter_init(self) -> None:
        self.usage = Usage()
        self._meter_lock = threading.Lock()
        self._taken: dict[int, float] = {}      # thread id -> when it took its slot

    def record(self, completions: int = 0, tokens: int = 0) -> None:
        """Count what one call served (the backend calls it after a sampling request)."""
        with self._meter_lock:
            self.usage.completions += completions
            self.usage.tokens += tokens
        self._publish()

    def record_error(self, status: int) -> None:
        """Count an overload answer (HTTP 429/502/503/504); other codes are not counted."""
        if status in OVERLOAD_CODES:
            with self._meter_lock:
                self.usage.errors += 1
            self._publish()

    def usage_now(self) -> Usage:
        """The counts so far, slot-seconds of slots still held included."""
        now = time.monotonic()
        with self._meter_lock:
            held = sum(now - t for t in self._taken.values())
            return self.usage + Usage(held_s=held)

    def _held_from(self) -> None:
        with self._meter_lock:
            self._taken[threading.get_ident()] = time.monotonic()

    def _held_until(self) -> None:
        with self._meter_lock:
            t = self._taken.pop(threading.get_ident(), None)
            if t is not None:
                self.usage.held_s += time.monotonic() - t
                self.usage.calls += 1
        self._publish()

    @abstractmethod
    def _publish(self) -> None:
        """Send the counts where the campaign's controller reads them (or note that they
        changed, for a thread that sends them)."""

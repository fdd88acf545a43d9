"""What the two slot semaphores share: `with sem:` takes one slot for this thread or times out.

`slots.CountingSemaphore` (files, one machine) and `slots_ray.RaySlots` (a Ray actor, many
machines) differ only in how a slot is taken and given back. It lives on its own so that
`slots_ray` need not import `slots`, which imports it lazily.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Self


class SlotSemaphore(ABC):
    """At most `max_concurrent` holders; each thread holds at most one slot at a time.

    `wait_s` is the total time spent waiting to acquire, across threads; `where` names the
    shared place in messages (a folder, a Ray actor).
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

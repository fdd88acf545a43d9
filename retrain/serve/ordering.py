"""Per-model ordering: a model's training ops run one at a time, strictly in seq_id order.

The SDK numbers each training client's requests (seq_id 1, 2, ...) and may send them out
of order (forward_backward chunks go in parallel, chunk 0 last), so the server queues
each op until every lower seq_id has run. Runs on the event loop; the jobs themselves
await worker threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

Job = Callable[[], Awaitable[None]]


class Sequencer:
    """Runs submitted jobs in seq_id order, one at a time; remembers which ids it has seen."""

    def __init__(self, first_seq: int = 1):
        self.next_seq = first_seq
        self.request_ids: dict[int, str] = {}   # seq_id -> request id (for retried submits)
        self._pending: dict[int, Job] = {}
        self._running = False
        self._on_idle: list[Callable[[], None]] = []
        self._tasks: set[asyncio.Task] = set()

    def seen(self, seq_id: int) -> str | None:
        """The request id already given to `seq_id`, if this op was submitted before."""
        return self.request_ids.get(seq_id)

    def submit(self, seq_id: int | None, request_id: str, job: Job) -> int:
        """Queue `job` as `seq_id` (None = after everything queued); returns the seq used."""
        if seq_id is None:
            seq_id = max([self.next_seq - 1, *self._pending, *self.request_ids]) + 1
        if seq_id < self.next_seq or seq_id in self._pending:
            raise ValueError(f"seq_id {seq_id} was already used for this model")
        self.request_ids[seq_id] = request_id
        self._pending[seq_id] = job
        self._pump()
        return seq_id

    @property
    def idle(self) -> bool:
        return not self._running and not self._pending

    def when_idle(self, callback: Callable[[], None]) -> None:
        """Call `callback` once nothing is running or queued (now, if already idle)."""
        if self.idle:
            callback()
        else:
            self._on_idle.append(callback)

    def _pump(self) -> None:
        if self._running:
            return
        job = self._pending.pop(self.next_seq, None)
        if job is None:
            if not self._pending:
                callbacks, self._on_idle = self._on_idle, []
                for cb in callbacks:
                    cb()
            return
        self._running = True
        task = asyncio.get_running_loop().create_task(self._run(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, job: Job) -> None:
        try:
            await job()
        finally:
            self.next_seq += 1
            self._running = False
            self._pump()

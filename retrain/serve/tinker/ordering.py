"""Per-model ordering: a model's training ops run one at a time, strictly in seq_id order.

The SDK numbers each training client's requests (seq_id 1, 2, ...) and may send them out
of order (forward_backward chunks go in parallel, chunk 0 last), so the server queues
each op until every lower seq_id has run. A request the server refuses (a 400) still
takes its place: `skip` marks it done, or the client's next op would wait for it forever.
Where a refusal cannot name its seq_id (a body too large or unreadable), a hole in the
order that later ops wait behind is given up after `gap_s`. Runs on the event loop; the
jobs themselves await worker threads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("retrain.serve")

Job = Callable[[], Awaitable[None]]

# The SDK sends an op only once the one before it has been answered, so a hole with later
# ops queued is a refused request, or chunk 0 of a forward_backward sent in parallel chunks
# (sent last, right after the others were accepted). Long enough for that chunk's upload.
GAP_S = 60.0


async def _skipped() -> None:
    """The job of a refused request: nothing to run, its place is done."""


class Sequencer:
    """Runs submitted jobs in seq_id order, one at a time; remembers which ids it has seen."""

    def __init__(self, first_seq: int = 1, gap_s: float = GAP_S):
        self.next_seq = first_seq
        self.gap_s = gap_s
        self.request_ids: dict[int, str] = {}   # seq_id -> request id (for retried submits)
        self._pending: dict[int, Job] = {}
        self._running = False
        self._on_idle: list[Callable[[], None]] = []
        self._tasks: set[asyncio.Task] = set()
        self._gap_timer: asyncio.TimerHandle | None = None

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

    def skip(self, seq_id: int) -> None:
        """Mark `seq_id` done without running anything (its request was refused); ignored
        when that place already holds a job or has passed."""
        if seq_id >= self.next_seq and seq_id not in self._pending:
            self._pending[seq_id] = _skipped
            self._pump()

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
        while self._pending.get(self.next_seq) is _skipped:
            del self._pending[self.next_seq]
            self.next_seq += 1
        job = self._pending.pop(self.next_seq, None)
        if job is None:
            self._watch_gap()
            if not self._pending:
                callbacks, self._on_idle = self._on_idle, []
                for cb in callbacks:
                    cb()
            return
        self._cancel_gap_timer()
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

    def _watch_gap(self) -> None:
        """With ops queued behind a missing seq_id, give that hole up after gap_s."""
        if not self._pending:
            self._cancel_gap_timer()
        elif self._gap_timer is None:
            self._gap_timer = asyncio.get_running_loop().call_later(
                self.gap_s, self._give_up_gap, self.next_seq)

    def _give_up_gap(self, missing: int) -> None:
        self._gap_timer = None
        if self._running or self.next_seq != missing or not self._pending:
            self._pump()
            return
        resume = min(self._pending)
        log.warning("seq_id %d..%d never arrived within %.0f s (refused before it could be "
                    "queued?); running seq_id %d", missing, resume - 1, self.gap_s, resume)
        self.next_seq = resume
        self._pump()

    def _cancel_gap_timer(self) -> None:
        if self._gap_timer is not None:
            self._gap_timer.cancel()
            self._gap_timer = None

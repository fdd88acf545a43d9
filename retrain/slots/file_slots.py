"""The API budget: "hold one slot" around each remote request, and its implementations.

The ground floor for the trainer, the backends and `status`: they see only `ApiSlots`
(`with slots:` holds one slot; `wait_s` is the time spent waiting). Implementations:
- `NoSlots`: a standalone run, never waits.
- `CountingSemaphore`: `max_concurrent` flock'ed slot files in one folder, shared by every
  worker of a campaign on one machine (the local executor).
- `retrain.slots.ray_slots.RaySlots`: a named Ray actor shared by workers on every node of a
  cluster (the Ray executor); imported only when $RETRAIN_API_SLOTS names it.

How the file semaphore stays correct and fair:
- Crash-safe: a slot is held by an exclusive flock on `slot-<i>.lock`. The kernel drops the
  lock when its holder exits for any reason (SIGKILL included), so the slot frees at once.
- Fair: waiters line up on `queue.lock` (a blocking flock, so they sleep in the kernel and
  cost nothing). Only the head of the line looks for a slot, trying every slot in a random
  order each round, so it takes whichever slot frees first. A holder that releases and
  re-acquires at once joins the line behind the others instead of grabbing its slot back.
- Prompt: between rounds the head sleeps on `doorbell.fifo`, which every release rings, so
  a freed slot is taken within microseconds; the sleep is capped at POLL_CAP_S because a
  killed holder frees its slot without ringing. (Measured: bench/semaphore.py.)
- Threads: each `acquire` opens its own file descriptors, and flocks on separate open files
  exclude each other even inside one process, so several threads can share one semaphore
  object, each holding its own slot. A thread may hold at most one slot of a semaphore at a
  time (acquire again before release raises RuntimeError instead of deadlocking).
- Local filesystems only: flock on NFS/SMB is emulated or absent, so slots may not exclude
  each other there. Keep the campaign folder on a local disk.
- Slot descriptors are close-on-exec; do not `os.fork()` while holding a slot (the child
  would share it).
- A cap that changes (`max_concurrent = "auto"`): the folder then holds `cap`, a number the
  campaign runner's controller replaces atomically (write, then rename: a reader sees the old
  or the new number, never half). The head of the line reads it each round and takes a slot
  only while fewer than `cap` of the `max_concurrent` slot files are held, so after a cut no
  new call starts until the calls in flight are below the new cap.
- Usage meters: each semaphore object writes its counts (`slot_semaphore.Usage`) to
  `meters/<pid>-<id>.json` every PUBLISH_EVERY_S while it is used; `usage_of(folder)` sums
  them for the controller.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import random
import select
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

from retrain.errors import UserError
from retrain.slots.semaphore import SlotSemaphore, Usage

ENV_VAR = "RETRAIN_API_SLOTS"
QUEUE_FILE = "queue.lock"
DOORBELL_FILE = "doorbell.fifo"
SLOT_GLOB = "slot-*.lock"
FIRST_POLL_S = 0.0002   # the head of the line polls with exponential backoff up to POLL_CAP_S
POLL_CAP_S = 0.002
RAY_PREFIX = "ray:"       # RETRAIN_API_SLOTS=ray:<actor name>:<max_concurrent> names a RaySlots
CAP_FILE = "cap"          # the current cap, when the campaign's controller owns it
METERS_DIR = "meters"
PUBLISH_EVERY_S = 0.1     # the meter file's staleness: 0.1 s in a 3 s interval is 3%


class ApiSlots(Protocol):
    """A counting semaphore held around each remote API request (`with slots: call()`).

    `wait_s` is the total time spent waiting to acquire, so callers can log it per step.
    """

    wait_s: float

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...

    def record(self, completions: int = 0, tokens: int = 0) -> None:
        """Count what one call served."""

    def record_error(self, status: int) -> None:
        """Count an overload answer (HTTP 429/502/503/504)."""


class NoSlots:
    """The semaphore of a standalone run: never waits, counts nothing."""

    wait_s = 0.0

    def __enter__(self) -> NoSlots:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def record(self, completions: int = 0, tokens: int = 0) -> None:
        return None

    def record_error(self, status: int) -> None:
        return None



class CountingSemaphore(SlotSemaphore):
    """At most `max_concurrent` holders across every process using `folder`.

    `with sem:` acquires (raising TimeoutError after `timeout` seconds, when set) and releases;
    `wait_s` is the total time spent waiting to acquire, across threads.
    """

    def __init__(self, folder: str | Path, max_concurrent: int, timeout: float | None = None):
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_concurrent = max_concurrent
        self.timeout = timeout
        self.wait_s = 0.0
        self._slots = [str(self.folder / f"slot-{i}.lock") for i in range(max_concurrent)]
        self._queue = str(self.folder / QUEUE_FILE)
        self._held = threading.local()
        self._wait_lock = threading.Lock()
        self._bell = _open_doorbell(self.folder / DOORBELL_FILE)
        self._cap_path = self.folder / CAP_FILE
        self._meter_init()
        self._meter_path = self.folder / METERS_DIR / f"{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
        self._publisher: threading.Thread | None = None
        self._dirty = threading.Event()

    def acquire(self, timeout: float | None = None) -> bool:
        if getattr(self._held, "fd", None) is not None:
            raise self.not_reentrant()
        start = time.monotonic()
        deadline = None if timeout is None else start + max(0.0, timeout)
        try:
            queue_fd = _lock_file(self._queue, deadline)
            if queue_fd is None:
                return False
            try:
                won = self._take_slot(deadline)
            finally:
                os.close(queue_fd)  # closing drops the flock: the next in line becomes head
            if won:
                self._held_from()
            return won
        finally:
            with self._wait_lock:
                self.wait_s += time.monotonic() - start

    def release(self) -> None:
        fd = getattr(self._held, "fd", None)
        if fd is None:
            raise self.not_held()
        self._held.fd = None
        os.close(fd)
        self._held_until()
        if self._bell is not None:
            # A full pipe means rings nobody read yet: the head wakes anyway.
            with contextlib.suppress(BlockingIOError):
                os.write(self._bell, b"!")  # wake the head of the line now

    def close(self) -> None:
        """Close the doorbell (slots held by threads stay held until released)."""
        bell, self._bell = self._bell, None
        if bell is not None:
            os.close(bell)

    def __del__(self) -> None:
        bell = getattr(self, "_bell", None)
        if bell is not None:
            os.close(bell)

    @property
    def where(self) -> str:
        return str(self.folder)

    def _take_slot(self, deadline: float | None) -> bool:
        """As head of the line: poll every slot in random order until one is ours (with a
        cap file: only while fewer than the cap are held)."""
        fds = [_open(p) for p in self._slots]
        won = None
        try:
            delay = FIRST_POLL_S
            while won is None:
                if self._under_cap(fds):
                    won = self._lock_any(fds)
                if won is not None:
                    self._held.fd = fds[won]
                else:
                    now = time.monotonic()
                    if deadline is not None and now >= deadline:
                        return False
                    pause = delay if deadline is None else min(delay, deadline - now)
                    self._sleep(pause)
                    delay = min(delay * 2, POLL_CAP_S)
            return True
        finally:
            for i, fd in enumerate(fds):
                if i != won:
                    os.close(fd)

    @staticmethod
    def _lock_any(fds: list[int]) -> int | None:
        for i in random.sample(range(len(fds)), len(fds)):
            if _try_lock(fds[i]):
                return i
        return None

    def _under_cap(self, fds: list[int]) -> bool:
        """Whether the cap file (if any) allows one more holder right now."""
        cap = read_cap(self.folder, self._cap_path)
        if cap is None or cap >= len(fds):
            return True
        held = 0
        for fd in fds:  # only the head of the line takes slots: the count can only fall
            if _try_lock(fd, fcntl.LOCK_SH):
                fcntl.flock(fd, fcntl.LOCK_UN)
            else:
                held += 1
        return held < cap

    def _publish(self) -> None:
        """Wake the publisher thread (started on first use), which writes the meter file."""
        self._dirty.set()
        if self._publisher is None:
            with self._meter_lock:
                if self._publisher is None:
                    self._publisher = threading.Thread(target=self._publish_loop, daemon=True,
                                                       name="retrain-slot-meter")
                    self._publisher.start()

    def _publish_loop(self) -> None:
        while True:
            self._dirty.wait()
            time.sleep(PUBLISH_EVERY_S)
            with self._meter_lock:
                busy = bool(self._taken)
            if not busy:
                self._dirty.clear()  # a slot still held keeps its slot-seconds flowing
            self.flush_meter()

    def flush_meter(self) -> None:
        """Write this object's counts now (atomically: write, then rename)."""
        with contextlib.suppress(OSError):
            self._meter_path.parent.mkdir(exist_ok=True)
            tmp = self._meter_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.usage_now().to_dict()))
            os.replace(tmp, self._meter_path)

    def _sleep(self, seconds: float) -> None:
        """Sleep until a release rings the doorbell or `seconds` pass (a killed holder cannot)."""
        if self._bell is None:
            time.sleep(seconds)
            return
        ready, _, _ = select.select([self._bell], [], [], seconds)
        if ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._bell, 4096)


def _open_doorbell(path: Path) -> int | None:
    """A FIFO every user of the folder keeps open read-write; None where FIFOs do not work."""
    try:
        os.mkfifo(path, 0o644)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        if not stat.S_ISFIFO(os.stat(path).st_mode):
            return None
        return os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None


def _open(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


def _try_lock(fd: int, mode: int = fcntl.LOCK_EX) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


def _lock_file(path: str, deadline: float | None) -> int | None:
    """An fd holding an exclusive flock on `path`, or None if `deadline` passes first."""
    fd = _open(path)
    try:
        if deadline is None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # sleeps in the kernel; the GIL is released
            return fd
        delay = FIRST_POLL_S
        while not _try_lock(fd):
            now = time.monotonic()
            if now >= deadline:
                os.close(fd)
                return None
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, POLL_CAP_S)
        return fd
    except BaseException:
        os.close(fd)
        raise


def slots_in_use(folder: str | Path) -> int:
    """How many slots in `folder` are held right now (0 when the folder does not exist)."""
    held = 0
    for path in sorted(Path(folder).glob(SLOT_GLOB)):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if _try_lock(fd, fcntl.LOCK_SH):
                fcntl.flock(fd, fcntl.LOCK_UN)
            else:
                held += 1
        finally:
            os.close(fd)
    return held


def read_cap(folder: str | Path, path: Path | None = None) -> int | None:
    """The cap the campaign's controller set in `folder`, or None (a fixed cap: no file)."""
    try:
        text = (path or Path(folder) / CAP_FILE).read_text()
    except OSError:
        return None
    try:
        return max(1, int(text))
    except ValueError:
        return None  # cannot happen with write_cap's rename; be safe anyway


def write_cap(folder: str | Path, cap: int) -> None:
    """Set the cap every worker's head of the line reads (atomically: write, then rename)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{CAP_FILE}.{os.getpid()}.tmp"
    tmp.write_text(f"{int(cap)}\n")
    os.replace(tmp, folder / CAP_FILE)


def clear_cap(folder: str | Path) -> None:
    """Back to a fixed cap (the slot files themselves are the cap)."""
    with contextlib.suppress(FileNotFoundError):
        (Path(folder) / CAP_FILE).unlink()


def usage_of(folder: str | Path) -> Usage:
    """The usage every worker of the campaign has reported through `folder` so far."""
    total = Usage()
    for path in sorted(Path(folder, METERS_DIR).glob("*.json")):
        try:
            total = total + Usage.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return total


def env_value(folder: str | Path, max_concurrent: int) -> str:
    """The RETRAIN_API_SLOTS value that points workers at `folder`."""
    return f"{Path(folder).resolve()}:{max_concurrent}"


def slots_from_env() -> ApiSlots:
    """The campaign's slots named by $RETRAIN_API_SLOTS, or a no-op for a standalone run.

    `<absolute folder>:<n>` is a file semaphore; `ray:<actor name>:<n>` the Ray executor's
    slot actor (Ray is imported only then)."""
    value = os.environ.get(ENV_VAR, "").strip()
    if not value:
        return NoSlots()
    where, _, count = value.rpartition(":")
    try:
        n = int(count)
    except ValueError:
        n = 0
    is_ray = where.startswith(RAY_PREFIX)
    if not where or n < 1 or (is_ray and not where[len(RAY_PREFIX):]):
        raise UserError(f"{ENV_VAR}={value!r}: expected '<absolute folder>:<max_concurrent>' "
                        "(or 'ray:<actor name>:<max_concurrent>') with max_concurrent >= 1; "
                        "unset it for a standalone run")
    if is_ray:
        from retrain.slots.ray_slots import RaySlots  # only Ray campaigns pay for importing ray

        return RaySlots(where[len(RAY_PREFIX):], n)
    return CountingSemaphore(where, n)

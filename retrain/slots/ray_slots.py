"""The API budget across nodes: one named, detached Ray actor hands out `max_concurrent` slots.

- Same contract as the file semaphore (`retrain.slots.file_slots.ApiSlots`): `with slots:` holds
  one slot, `wait_s` adds up the time spent waiting; waiters queue, nothing fails for lack
  of a slot.
- FIFO-fair: waiters are served in arrival order at the actor; a holder that releases and
  asks again joins the back of the line.
- Dead holders: each process renews the leases of the slots it holds every HEARTBEAT_S from a
  daemon thread; the actor releases a lease not renewed for LEASE_S (its holder's process or
  node died). LEASE_S is ten heartbeats so a briefly starved holder keeps its slot.
  (Measured release time: bench/ray_semaphore.py, bench/RESULTS.md.)
- A stalled holder (SIGSTOP, the GIL held for seconds) can be granted a slot that expires
  before it sees the grant: when the grant took over half a lease to arrive, the holder asks
  the actor whether it still holds it before going on, and queues again if not.
- The actor restarted (its node died): it comes back with an empty table, so for one lease it
  grants nothing new while live holders re-register through their renewals; calls sent to it
  meanwhile are retried on the new instance. The cap holds across the restart.
- The actor counts the peak number of holders, grants and expired leases, so tests and
  `status` can check that `max_concurrent` held across every node; `stats` also names the
  holders (`host:pid:nonce`, `holder_pid`), so a fault injector can stop a process that
  holds a slot.
- With `max_concurrent = "auto"` the actor owns the cap: the campaign runner's controller
  calls `resize`, and after a cut no slot is granted until the holders are below the new cap.
  The actor meters slot-seconds held and calls exactly (it sees every grant and release);
  workers add completions, tokens and overload answers with their heartbeat (`report`).

Ray is imported inside the functions here; importing this module costs nothing.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any

from retrain.campaign import ray_address
from retrain.slots.semaphore import SlotSemaphore, Usage

NAMESPACE = "retrain"
HEARTBEAT_S = 0.5
LEASE_S = 5.0


class SlotBroker:
    """The actor's state: who holds a slot (with their last renewal) and who waits, in order."""

    def __init__(self, max_concurrent: int, lease_s: float = LEASE_S,
                 restarted: bool | None = None):
        self.max_concurrent = max_concurrent
        self.lease_s = lease_s
        self.holders: dict[str, float] = {}              # holder id -> last renewal (monotonic)
        self.granted_at: dict[str, float] = {}           # holder id -> when it got its slot
        self.usage = Usage()
        self.queue: OrderedDict[str, asyncio.Future] = OrderedDict()
        self.peak = self.grants = self.expired = self.reregistered = 0
        self.restarted = _restarted_by_ray() if restarted is None else restarted
        # Restarted with an empty table: the slots it forgot may still be in use. Grant nothing
        # new for one lease; live holders re-register meanwhile (their renewals), the others'
        # leases would have expired by then.
        self.recover_until = time.monotonic() + lease_s if self.restarted else 0.0
        self._reaper: asyncio.Task | None = None

    def recovering(self) -> bool:
        return time.monotonic() < self.recover_until

    async def acquire(self, holder: str) -> bool:
        """Wait for a slot in arrival order; True once `holder` holds it."""
        self._start_reaper()
        if holder in self.holders:
            return True
        if len(self.holders) < self.max_concurrent and not self.queue and not self.recovering():
            self._grant(holder)
            return True
        future = asyncio.get_running_loop().create_future()
        self.queue[holder] = future
        await future
        return True

    async def release(self, holder: str) -> None:
        self.holders.pop(holder, None)
        self._stop_clock(holder)
        self._hand_on()

    async def report(self, delta: dict) -> None:
        """A worker's completions, tokens and overload answers since its last report."""
        d = Usage.from_dict(delta)
        self.usage = self.usage + Usage(completions=d.completions, tokens=d.tokens,
                                        errors=d.errors)

    def _stop_clock(self, holder: str) -> None:
        t = self.granted_at.pop(holder, None)
        if t is not None:
            self.usage.held_s += time.monotonic() - t

    async def abandon(self, holder: str) -> None:
        """A waiter gave up (timeout): leave the line, or give back a slot granted meanwhile."""
        future = self.queue.pop(holder, None)
        if future is not None and not future.done():
            future.cancel()
        await self.release(holder)

    async def renew(self, holders: list[str]) -> list[str]:
        """Extend these leases; returns the ones it no longer knows (expired)."""
        self._start_reaper()
        now = time.monotonic()
        lost = []
        for h in holders:
            if h in self.holders:
                self.holders[h] = now
            elif self.recovering() and len(self.holders) < self.max_concurrent:
                self.holders[h] = self.granted_at[h] = now  # held since before the restart
                self.reregistered += 1
                self.peak = max(self.peak, len(self.holders))
            else:
                lost.append(h)
        return lost

    async def resize(self, max_concurrent: int) -> None:
        self.max_concurrent = max_concurrent
        self._hand_on()

    async def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        held = sum(now - t for t in self.granted_at.values())
        usage = self.usage + Usage(calls=self.grants, held_s=held)
        return {"max_concurrent": self.max_concurrent, "in_use": len(self.holders),
                "waiting": len(self.queue), "peak": self.peak, "grants": self.grants,
                "expired": self.expired, "lease_s": self.lease_s,
                "restarted": self.restarted, "reregistered": self.reregistered,
                "recovering": self.recovering(), "usage": usage.to_dict(),
                "holders": sorted(self.holders)}

    def _grant(self, holder: str) -> None:
        self.holders[holder] = self.granted_at[holder] = time.monotonic()
        self.grants += 1
        self.peak = max(self.peak, len(self.holders))

    def _hand_on(self) -> None:
        """Give free slots to the head of the line (none while recovering from a restart)."""
        while not self.recovering() and self.queue and len(self.holders) < self.max_concurrent:
            holder, future = self.queue.popitem(last=False)
            if future.done():
                continue
            self._grant(holder)
            future.set_result(True)

    def _start_reaper(self) -> None:
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 10)
            cutoff = time.monotonic() - self.lease_s
            dead = [h for h, t in self.holders.items() if t < cutoff]
            for h in dead:
                del self.holders[h]
                self._stop_clock(h)
            self.expired += len(dead)
            if dead or self.queue:  # also when a restart's recovery has just ended
                self._hand_on()


def _restarted_by_ray() -> bool:
    """Whether this is a Ray actor that Ray restarted (after its process or node died)."""
    try:
        import ray

        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # not inside a Ray actor
        return False


def new_holder_id() -> str:
    """A slot holder's id: `host:pid:nonce`, one per acquire."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def holder_pid(holder: str) -> int:
    """The process id in a holder id (`new_holder_id`); 0 when it has none."""
    parts = holder.rsplit(":", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else 0


def broker_name(campaign_key: str) -> str:
    return f"slots:{campaign_key}"


def ensure_broker(name: str, max_concurrent: int, lease_s: float = LEASE_S) -> Any:
    """The named broker actor, created detached on first use (it outlives any one driver)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # On the driver's node (a worker node may leave); restarted elsewhere if that node dies,
    # with an empty table: it then grants nothing for a lease while holders re-register, and
    # calls made to it meanwhile are retried on the new instance (max_task_retries).
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    actor_cls = ray.remote(SlotBroker)
    broker = actor_cls.options(name=name, namespace=NAMESPACE, lifetime="detached",
                               get_if_exists=True, num_cpus=0, max_concurrency=10_000,
                               max_restarts=-1, max_task_retries=-1, scheduling_strategy=here
                               ).remote(max_concurrent, lease_s)
    ray.get(broker.resize.remote(max_concurrent))
    return broker


def find_broker(name: str) -> Any | None:
    import ray

    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def explicit_address(address: str = "") -> str:
    """The address a `connect(address)` would join by name: `address`, else $RAY_ADDRESS
    ('' or "auto": the cluster running on this machine)."""
    return (address or os.environ.get("RAY_ADDRESS", "")).strip()


def connect(address: str = "") -> None:
    """Join the cluster at `address`, $RAY_ADDRESS or the one running on this machine;
    ConnectionError when there is none, or the address is malformed or does not answer (a
    campaign then starts its own: `campaign.ray_cluster`). Keeps this process's SIGTERM
    handler: ray.init replaces it with an exit, and the trainer's handler is what
    checkpoints on SIGTERM."""
    import signal

    import ray

    if ray.is_initialized():
        return
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        _init(explicit_address(address))
    finally:
        if main and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _init(target: str) -> None:
    """ray.init, after the address is parsed and probed (2 s): Ray itself answers a malformed
    address with a traceback and waits minutes on one nobody answers (a stale
    ray_current_cluster file left by a head that crashed)."""
    import ray

    kwargs = dict(namespace=NAMESPACE, log_to_driver=False, logging_level="WARNING",
                  configure_logging=False)
    try:
        address = ray_address.parse(target)
    except ValueError as exc:
        raise ConnectionError(str(exc)) from None
    if address is not None:
        _check_answers(address)
        ray.init(address=target.strip(), **kwargs)
        return
    found = _address_of_this_machines_cluster()
    if found and _reachable(found):
        ray.init(address=found, **kwargs)
        return
    raise ConnectionError("no Ray cluster is running on this machine"
                          + (f" ({found}, recorded by Ray, does not answer)" if found else ""))


def _check_answers(address: ray_address.RayAddress) -> None:
    """ConnectionError unless the address answers and, for ray://, Ray Client is installed."""
    if not _answers(address):
        raise ConnectionError(f"no Ray cluster answers at {address} ([campaign] ray_address "
                              "or $RAY_ADDRESS); start it with `ray start --head`, or fix "
                              "the address")
    if address.scheme == "ray":
        from ray._private.utils import get_ray_client_dependency_error

        if get_ray_client_dependency_error() is not None:
            raise ConnectionError(f"{address} is a Ray Client address, which needs "
                                  "`pip install 'ray[client]'`; or give the head's host:port "
                                  "(6379) from a machine of the cluster")


def _address_of_this_machines_cluster() -> str:
    """What `ray start` recorded on this machine ('' when nothing is)."""
    try:
        from ray._common.utils import get_ray_address_file

        path = Path(get_ray_address_file(None))
    except ImportError:  # moved in another Ray version: its default place
        path = Path("/tmp/ray/ray_current_cluster")
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _reachable(text: str) -> bool:
    """Whether `text` is a host:port that answers (what Ray recorded may be stale)."""
    try:
        address = ray_address.parse(text)
    except ValueError:
        return False
    return address is not None and _answers(address)


def _answers(address: ray_address.RayAddress, timeout_s: float = 2.0) -> bool:
    """Whether something accepts a TCP connection at the address within `timeout_s`."""
    try:
        with socket.create_connection((address.host, address.port), timeout=timeout_s):
            return True
    except (OSError, ValueError):  # refused, unknown host, timeout
        return False


class RaySlots(SlotSemaphore):
    """A worker's handle on the broker: the `ApiSlots` of a Ray campaign.

    Several threads may share it, each holding at most one slot at a time (like the file
    semaphore). Connects to the cluster on first use, so a run that never calls the API
    never pays for it.
    """

    def __init__(self, name: str, max_concurrent: int, timeout: float | None = None):
        self.name = name
        self.max_concurrent = max_concurrent
        self.timeout = timeout
        self.wait_s = 0.0
        self.lost = 0  # grants found expired on arrival (the holder had stalled), re-queued
        self._held: set[str] = set()
        self._mine = threading.local()
        self._lock = threading.Lock()
        self._broker: Any = None
        self._beat: threading.Thread | None = None
        self._meter_init()
        self._sent = Usage()      # what the heartbeat has reported to the actor so far

    def acquire(self, timeout: float | None = None) -> bool:
        import ray

        if getattr(self._mine, "holder", None) is not None:
            raise self.not_reentrant()
        broker = self._connect()
        holder = new_holder_id()
        start = time.monotonic()
        try:
            while True:
                asked = time.monotonic()
                left = None if timeout is None else max(0.0, start + timeout - asked)
                ray.get(broker.acquire.remote(holder), timeout=left)
                if time.monotonic() - asked < LEASE_S / 2 or self._still_held(holder):
                    break
                self.lost += 1  # granted while this process stalled, and expired: wait again
        except ray.exceptions.GetTimeoutError:
            ray.get(broker.abandon.remote(holder))
            return False
        finally:
            with self._lock:
                self.wait_s += time.monotonic() - start
        self._mine.holder = holder
        with self._lock:
            self._held.add(holder)
        return True

    def release(self) -> None:
        import ray

        holder = getattr(self._mine, "holder", None)
        if holder is None:
            raise self.not_held()
        self._mine.holder = None
        with self._lock:
            self._held.discard(holder)
        ray.get(self._broker.release.remote(holder))

    def _still_held(self, holder: str) -> bool:
        """Ask the actor (renewing the lease): a grant that came while this process was
        stalled (SIGSTOP, a GIL held for seconds) may have expired before it was seen."""
        import ray

        return not ray.get(self._broker.renew.remote([holder]))

    @property
    def where(self) -> str:
        return f"Ray actor {self.name}"

    def _publish(self) -> None:
        """Nothing now: the heartbeat thread sends the counts (`_report`)."""

    def _connect(self) -> Any:
        with self._lock:
            if self._broker is None:
                connect()
                self._broker = find_broker(self.name)
                if self._broker is None:
                    from retrain.errors import UserError

                    raise UserError(f"no Ray slot actor named {self.name!r} in namespace "
                                    f"{NAMESPACE!r}; was the campaign runner stopped? Run the "
                                    "campaign again to recreate it")
                self._beat = threading.Thread(target=self._heartbeat, daemon=True,
                                              name="retrain-slot-lease")
                self._beat.start()
            return self._broker

    def _heartbeat(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            with self._lock:
                held = list(self._held)
            if held:
                self._broker.renew.remote(held)  # fire and forget: the next beat follows
            self._report()

    def _report(self) -> None:
        with self._meter_lock:
            now = Usage(completions=self.usage.completions, tokens=self.usage.tokens,
                        errors=self.usage.errors)
        delta = now - self._sent
        if delta != Usage():
            self._broker.report.remote(delta.to_dict())
            self._sent = now

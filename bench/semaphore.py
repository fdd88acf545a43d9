"""Benchmark the campaign semaphore: uncontended latency and throughput under contention.

    python bench/semaphore.py                  # defaults: 12 processes, 3 slots, 30 x 5 ms holds
    python bench/semaphore.py --hold-ms 1 --rounds 100
    python bench/semaphore.py --hold-ms 20 --gap-ms 20   # workers that compute between calls
    python bench/semaphore.py --variants doorbell,ray    # + the Ray slot actor (needs ray)

Contention runs compare three variants on the same workload:
  doorbell   the shipped semaphore (line on queue.lock, head sleeps on the doorbell FIFO)
  polling    the same without the doorbell (head polls with backoff capped at 2 ms)
  slot0      the naive scheme: try every slot once, then block on slot 0
  ray        the Ray executor's slot actor (retrain.slots.ray_slots) on a local one-node Ray
             cluster started here; also reports its uncontended latency and how long a
             SIGKILLed holder keeps its slot
Reported: acquisitions/s, mean holders while saturated (ideal = slots), max holders,
mean and p99 wait per acquisition, and the spread of per-process finish times.
Numbers on a shared machine are noisy; compare variants within one invocation.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from retrain.slots import file_slots as sem_mod  # noqa: E402
from retrain.slots.file_slots import CountingSemaphore  # noqa: E402


class Slot0Semaphore:
    """The scheme to avoid: when all slots are busy every waiter blocks on slot 0."""

    def __init__(self, folder: str, n: int):
        self.paths = [os.path.join(folder, f"slot-{i}.lock") for i in range(n)]
        self.fd = None

    def __enter__(self):
        fds = [os.open(p, os.O_RDWR | os.O_CREAT) for p in self.paths]
        for fd in fds:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.fd = fd
                break
            except BlockingIOError:
                continue
        else:
            fcntl.flock(fds[0], fcntl.LOCK_EX)
            self.fd = fds[0]
        for fd in fds:
            if fd != self.fd:
                os.close(fd)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def worker(args: argparse.Namespace) -> None:
    if args.variant == "polling":
        sem_mod._open_doorbell = lambda path: None
    if args.variant == "ray":
        from retrain.slots.ray_slots import RaySlots

        sem = RaySlots(args.folder, args.slots)
        with sem:  # join the cluster and reach the actor before the start line
            pass
    else:
        sem = (Slot0Semaphore(args.folder, args.slots) if args.variant == "slot0"
               else CountingSemaphore(args.folder, args.slots))
    log = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    while time.monotonic() < args.start_at:
        time.sleep(0.001)
    hold = args.hold_ms / 1000
    for _ in range(args.rounds):
        t0 = time.monotonic()
        with sem:
            t1 = time.monotonic()
            os.write(log, f"+ {os.getpid()} {t1:.6f} {t1 - t0:.6f}\n".encode())
            time.sleep(hold)
            os.write(log, f"- {os.getpid()} {time.monotonic():.6f} 0\n".encode())
        time.sleep(args.gap_ms / 1000)  # work between API calls, holding no slot
    os.write(log, f"done {os.getpid()} {time.monotonic():.6f} 0\n".encode())


def contention(variant: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "events.log")
        # Ray workers first join the cluster (about a second each on a busy machine).
        start_at = time.monotonic() + 1.0 + (2.0 if variant == "ray" else 0.05) * args.procs
        folder = os.path.join(tmp, "slots")
        if variant == "ray":
            from retrain.slots.ray_slots import ensure_broker

            folder = f"slots:bench-{os.getpid()}-{time.monotonic_ns()}"
            ensure_broker(folder, args.slots)
        cmd = [sys.executable, __file__, "--worker", "--variant", variant, "--folder",
               folder, "--slots", str(args.slots), "--rounds",
               str(args.rounds), "--hold-ms", str(args.hold_ms), "--gap-ms", str(args.gap_ms),
               "--log", log,
               "--start-at", str(start_at)]
        os.makedirs(os.path.join(tmp, "slots"))
        procs = [subprocess.Popen(cmd) for _ in range(args.procs)]
        for p in procs:
            p.wait()
        return replay(Path(log).read_text().splitlines(), args)


def replay(lines: list[str], args: argparse.Namespace) -> dict:
    holders = peak = done = 0
    area = 0.0
    t_first = t_last = prev = None
    waits, finishes = [], []
    for line in lines:
        tag, _pid, t, wait = line.split()
        t = float(t)
        if t_first is not None and args.procs - done >= args.slots:
            area += holders * (t - prev)
            t_last = t
        if tag == "+":
            holders += 1
            waits.append(float(wait))
            t_first = t if t_first is None else t_first
        elif tag == "-":
            holders -= 1
        else:
            done += 1
            finishes.append(t)
        prev = t
        peak = max(peak, holders)
    total = max(finishes) - t_first
    waits.sort()
    return {"acq_per_s": len(waits) / total, "mean_holders": area / (t_last - t_first),
            "max_holders": peak, "wait_mean_ms": 1000 * statistics.fmean(waits),
            "wait_p99_ms": 1000 * waits[int(0.99 * (len(waits) - 1))],
            "finish_spread_s": max(finishes) - min(finishes), "wall_s": total}


def uncontended(n: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        return _acquire_release_times(CountingSemaphore(tmp, 4), n)


def ray_uncontended(n: int) -> dict:
    from retrain.slots.ray_slots import RaySlots, ensure_broker

    name = f"slots:bench-u-{os.getpid()}"
    ensure_broker(name, 4)
    sem = RaySlots(name, 4)
    with sem:
        pass  # connect outside the timing
    return _acquire_release_times(sem, n)


def _acquire_release_times(sem, n: int) -> dict:
    """n uncontended acquire + release pairs: mean, median and p99 in microseconds."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        with sem:
            pass
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"n": n, "mean_us": 1e6 * statistics.fmean(times),
            "p50_us": 1e6 * times[n // 2], "p99_us": 1e6 * times[int(0.99 * (n - 1))]}


HOLDER = "from retrain.slots.file_slots import slots_from_env; " \
         "s = slots_from_env(); s.acquire(); " \
         "print('held', flush=True); import time; time.sleep(600)"


def ray_dead_holder(trials: int) -> list[float]:
    """Seconds from SIGKILLing a holder until a waiter gets its (only) slot."""
    import signal

    from retrain.slots.file_slots import ENV_VAR
    from retrain.slots.ray_slots import RaySlots, ensure_broker

    out = []
    for i in range(trials):
        name = f"slots:bench-dead-{os.getpid()}-{i}"
        ensure_broker(name, 1)
        env = {**os.environ, ENV_VAR: f"ray:{name}:1"}
        proc = subprocess.Popen([sys.executable, "-c", HOLDER], env=env, text=True,
                                stdout=subprocess.PIPE)
        assert proc.stdout.readline().strip() == "held"
        time.sleep(1.0)
        proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        proc.wait()
        waiter = RaySlots(name, 1)
        waiter.acquire()
        out.append(time.monotonic() - killed)
        waiter.release()
    return out


def start_ray() -> None:
    import ray

    ray.init(address="local", num_cpus=1, object_store_memory=80 * 2**20, include_dashboard=False,
             namespace="retrain", log_to_driver=False)
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    os.environ["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=12)
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--hold-ms", type=float, default=5.0)
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="time each process spends between acquisitions")
    ap.add_argument("--uncontended", type=int, default=5000)
    ap.add_argument("--variants", default="doorbell,polling,slot0")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="doorbell", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--log", help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    u = uncontended(args.uncontended)
    print(f"uncontended acquire+release ({u['n']}x): mean {u['mean_us']:.1f} us, "
          f"p50 {u['p50_us']:.1f} us, p99 {u['p99_us']:.1f} us")
    if "ray" in args.variants.split(","):
        start_ray()
        u = ray_uncontended(min(args.uncontended, 1000))
        print(f"ray actor acquire+release ({u['n']}x): mean {u['mean_us']:.0f} us, "
              f"p50 {u['p50_us']:.0f} us, p99 {u['p99_us']:.0f} us")
        freed = ray_dead_holder(3)
        print("ray actor: SIGKILLed holder's slot free again after "
              + ", ".join(f"{x:.2f}s" for x in freed))
    print(f"contention: {args.procs} processes x {args.rounds} acquisitions, "
          f"{args.slots} slots, hold {args.hold_ms} ms, gap {args.gap_ms} ms "
          f"(ideal {1000 * args.slots / args.hold_ms:.0f} acq/s)")
    print(f"{'variant':10s} {'acq/s':>8s} {'holders':>8s} {'max':>4s} {'wait ms':>8s} "
          f"{'p99 ms':>8s} {'spread s':>9s}")
    for variant in args.variants.split(","):
        r = contention(variant, args)
        print(f"{variant:10s} {r['acq_per_s']:8.0f} {r['mean_holders']:8.2f} "
              f"{r['max_holders']:4d} {r['wait_mean_ms']:8.1f} {r['wait_p99_ms']:8.1f} "
              f"{r['finish_spread_s']:9.2f}")


if __name__ == "__main__":
    main()

"""The file semaphore under max_concurrent = "auto": the runner's cap file changes the cap
for every worker at once, and each worker's usage meter reaches the runner."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from retrain.slots.file_slots import CountingSemaphore, clear_cap, read_cap, usage_of, write_cap
from retrain.slots.semaphore import Usage

REPO = Path(__file__).resolve().parents[2]
HOLD_S = 0.01

# A holder appends "+ <t>" after acquiring and "- <t>" before releasing (O_APPEND: atomic).
WORKER = textwrap.dedent("""
    import os, sys, time
    from retrain.slots.file_slots import CountingSemaphore
    folder, log, stop, threads = sys.argv[1:5]
    sem = CountingSemaphore(folder, 8)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    import threading
    def hammer():
        while not os.path.exists(stop):
            with sem:
                os.write(fd, f"+ {time.time():.6f}\\n".encode())
                time.sleep(HOLD_S)
                os.write(fd, f"- {time.time():.6f}\\n".encode())
            sem.record(completions=2, tokens=10)
    ts = [threading.Thread(target=hammer) for _ in range(int(threads))]
    for t in ts: t.start()
    for t in ts: t.join()
    sem.flush_meter()
""").replace("HOLD_S", repr(HOLD_S))


def _peak_between(events: list[tuple[float, int]], t0: float, t1: float) -> int:
    """Most holders at once in [t0, t1], counting holds that began before t0 from t0."""
    alive = peak = 0
    for t, d in events:
        alive += d
        if t0 <= t <= t1:
            peak = max(peak, alive)
    return peak


def test_a_changing_cap_file_holds_across_processes(tmp_path):
    folder, log, stop = tmp_path / "slots", tmp_path / "log", tmp_path / "stop"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    write_cap(folder, 4)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, str(script), str(folder), str(log), str(stop),
                               "3"], env=env) for _ in range(3)]
    try:
        while not log.exists() or log.read_text().count("+") < 20:
            time.sleep(0.05)
        changes = []      # (just before the write, just after it, the new cap)
        for cap in (2, 6, 1, 3):
            time.sleep(0.8)
            before = time.time()
            write_cap(folder, cap)
            changes.append((before, time.time(), cap))
        time.sleep(0.8)
        end = time.time()
    finally:
        stop.write_text("")
        for p in procs:
            p.wait(timeout=60)
    assert all(p.returncode == 0 for p in procs)
    events = sorted((float(t), 1 if tag == "+" else -1)
                    for tag, t in (line.split() for line in log.read_text().splitlines()))
    for k, (_, t, cap) in enumerate(changes):
        t_next = changes[k + 1][0] if k + 1 < len(changes) else end
        peak = _peak_between(events, t + HOLD_S + 0.1, t_next)
        assert 1 <= peak <= cap, (cap, peak)
    holds = sum(d > 0 for _, d in events)
    usage = usage_of(folder)
    assert usage.calls == holds and usage.completions == 2 * holds
    assert usage.tokens == 10 * holds and usage.errors == 0
    assert usage.held_s >= holds * HOLD_S


def test_cap_file_round_trip_and_meter_counts_overloads_only(tmp_path):
    assert read_cap(tmp_path) is None
    write_cap(tmp_path, 7)
    assert read_cap(tmp_path) == 7
    clear_cap(tmp_path)
    assert read_cap(tmp_path) is None
    sem = CountingSemaphore(tmp_path, 2)
    with sem:
        sem.record_error(502)
        sem.record_error(400)   # a client error is no overload
        sem.record_error(429)
    sem.flush_meter()
    u = usage_of(tmp_path)
    assert u.calls == 1 and u.errors == 2 and u.held_s > 0
    (tmp_path / "meters" / "junk.json").write_text("{not json")
    assert usage_of(tmp_path) == u                     # a bad file counts as nothing
    assert Usage.from_dict({"calls": -3, "tokens": "x"}) == Usage()


def test_the_cap_is_read_while_waiting(tmp_path):
    """A waiter blocked by a cap of 1 gets its slot as soon as the cap rises."""
    write_cap(tmp_path, 1)
    sem = CountingSemaphore(tmp_path, 4)
    got = threading.Event()
    sem.acquire()

    def second():
        with sem:
            got.set()

    t = threading.Thread(target=second)
    t.start()
    assert not got.wait(0.3)
    write_cap(tmp_path, 2)
    assert got.wait(5)
    t.join(5)
    sem.release()

"""The cross-process semaphore: real processes, real flocks, a SIGKILLed holder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from retrain.errors import UserError
from retrain.slots.file_slots import (
    ENV_VAR,
    CountingSemaphore,
    NoSlots,
    env_value,
    slots_from_env,
    slots_in_use,
)

REPO = Path(__file__).resolve().parents[2]

# A holder appends "+" right after acquiring and "-" right before releasing (O_APPEND writes
# are atomic and ordered), so replaying the log can only under-count the true holders.
WORKER = textwrap.dedent("""
    import os, sys, time
    from retrain.slots.file_slots import CountingSemaphore
    folder, n, rounds, hold, log, start_at = sys.argv[1:7]
    sem = CountingSemaphore(folder, int(n))
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    def note(tag):
        os.write(fd, f"{tag} {os.getpid()} {time.monotonic():.6f}\\n".encode())
    while time.monotonic() < float(start_at):
        time.sleep(0.001)
    for _ in range(int(rounds)):
        with sem:
            note("+")
            time.sleep(float(hold))
            note("-")
    note("done")
""")


def _spawn(tmp_path: Path, args: list[str]) -> subprocess.Popen:
    script = tmp_path / "worker.py"
    if not script.exists():  # rewriting it while a sibling starts would hand it an empty file
        script.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, str(script), *args], env=env)


def _replay(log: Path, n_procs: int, cap: int) -> tuple[int, float]:
    """(max holders seen, time-weighted mean holders while >= cap processes still had work)."""
    events = [line.split() for line in log.read_text().splitlines()]
    holders = peak = 0
    done = 0
    area = 0.0
    t_first = t_last = None
    prev_t = None
    for tag, _pid, t in events:
        t = float(t)
        saturated = n_procs - done >= cap
        if t_first is not None and saturated and prev_t is not None:
            area += holders * (t - prev_t)
            t_last = t
        if tag == "+":
            holders += 1
            t_first = t if t_first is None else t_first
        elif tag == "-":
            holders -= 1
        else:
            done += 1
        prev_t = t
        peak = max(peak, holders)
    return peak, area / (t_last - t_first)


def test_twelve_processes_never_exceed_cap_and_stay_saturated(tmp_path):
    log = tmp_path / "events.log"
    procs, cap, rounds = 12, 3, 30
    start_at = time.monotonic() + 1.5  # every process imported and waiting before the race
    workers = [_spawn(tmp_path, [str(tmp_path / "slots"), str(cap), str(rounds), "0.02",
                                 str(log), str(start_at)]) for _ in range(procs)]
    for w in workers:
        assert w.wait(timeout=120) == 0
    peak, mean = _replay(log, procs, cap)
    lines = log.read_text().splitlines()
    assert sum(1 for x in lines if x.startswith("+")) == procs * rounds
    assert peak <= cap
    assert mean >= 2.5, f"mean holders while saturated {mean:.2f}"


def test_sigkilled_holder_frees_its_slot_at_once(tmp_path):
    folder = tmp_path / "slots"
    log = tmp_path / "events.log"
    holder = _spawn(tmp_path, [str(folder), "1", "1", "60", str(log), "0"])
    deadline = time.monotonic() + 30
    while not (log.exists() and log.read_text().startswith("+")):
        assert time.monotonic() < deadline and holder.poll() is None
        time.sleep(0.01)
    sem = CountingSemaphore(folder, 1)
    assert slots_in_use(folder) == 1
    assert sem.acquire(timeout=0.05) is False
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    t0 = time.monotonic()
    assert sem.acquire(timeout=30)
    assert time.monotonic() - t0 < 2  # at once: the dead holder's slot is not waited out
    assert slots_in_use(folder) == 1
    sem.release()
    assert slots_in_use(folder) == 0


def test_threads_each_hold_their_own_slot(tmp_path):
    sem = CountingSemaphore(tmp_path, 2)
    inside = []
    peak = []
    lock = threading.Lock()

    def work():
        for _ in range(10):
            with sem:
                with lock:
                    inside.append(1)
                    peak.append(len(inside))
                time.sleep(0.005)
                with lock:
                    inside.pop()

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(peak) == 60
    assert max(peak) == 2  # never 3, and both slots were really used concurrently
    assert slots_in_use(tmp_path) == 0


def test_timeout_returns_false_and_context_manager_raises(tmp_path):
    a = CountingSemaphore(tmp_path, 1)
    b = CountingSemaphore(tmp_path, 1, timeout=0.05)
    assert a.acquire()
    t0 = time.monotonic()
    assert b.acquire(timeout=0.1) is False
    assert 0.09 <= time.monotonic() - t0 < 5.0
    assert b.wait_s >= 0.09
    with pytest.raises(TimeoutError, match="no API slot"), b:
        pass
    a.release()
    with b:
        assert slots_in_use(tmp_path) == 1
    assert slots_in_use(tmp_path) == 0


def test_not_reentrant_and_release_without_hold(tmp_path):
    sem = CountingSemaphore(tmp_path, 3)
    with pytest.raises(RuntimeError, match="holds no slot"):
        sem.release()
    with sem, pytest.raises(RuntimeError, match="not reentrant"):
        sem.acquire()
    assert slots_in_use(tmp_path) == 0


def test_wait_time_measures_blocking(tmp_path):
    holder = CountingSemaphore(tmp_path, 1)
    waiter = CountingSemaphore(tmp_path, 1)
    held = threading.Event()

    def hold():
        with holder:
            held.set()
            time.sleep(0.2)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    assert waiter.acquire(timeout=10)
    waiter.release()
    t.join()
    assert 0.1 <= waiter.wait_s < 5.0


def test_release_from_another_thread_is_refused(tmp_path):
    sem = CountingSemaphore(tmp_path, 1)
    sem.acquire()
    errors = []
    t = threading.Thread(target=lambda: errors.append(_raises(sem.release)))
    t.start()
    t.join()
    assert errors == [RuntimeError]
    sem.release()


def _raises(fn) -> type | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects the type
        return type(exc)
    return None


def test_slots_from_env(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert isinstance(slots_from_env(), NoSlots)
    monkeypatch.setenv(ENV_VAR, env_value(tmp_path / "s", 3))
    sem = slots_from_env()
    assert isinstance(sem, CountingSemaphore)
    assert sem.max_concurrent == 3 and sem.folder == (tmp_path / "s").resolve()
    for bad in ("nocolon", f"{tmp_path}:0", f"{tmp_path}:x", ":3"):
        monkeypatch.setenv(ENV_VAR, bad)
        with pytest.raises(UserError, match=ENV_VAR):
            slots_from_env()


def test_slots_in_use_of_missing_folder(tmp_path):
    assert slots_in_use(tmp_path / "nope") == 0


def test_bad_max_concurrent(tmp_path):
    with pytest.raises(ValueError):
        CountingSemaphore(tmp_path, 0)

"""The slot actor on a real 3-node Ray cluster on this machine: `max_concurrent` holds across
nodes, waiters are served first come first served, and a SIGKILLed holder's slot comes back
within the lease. One cluster for the module."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'retrain[ray]')")

from retrain.slots import ray_slots as slots_ray  # noqa: E402
from retrain.slots.file_slots import ENV_VAR, slots_from_env  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    os.environ["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": 80 * 2**20, "include_dashboard": False})
    for _ in range(2):
        c.add_node(num_cpus=1, object_store_memory=80 * 2**20)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace=slots_ray.NAMESPACE, log_to_driver=False)
    # Tasks defined here are shipped by value: the workers cannot import this test module.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield c
    ray.shutdown()
    c.shutdown()


def _stats(name: str) -> dict:
    return ray.get(slots_ray.find_broker(name).stats.remote())


def _hammer(name: str, n: int, rounds: int, hold_s: float) -> list[tuple[str, float, float]]:
    """On one node: take and give back a slot `rounds` times; (node, start, end) per hold."""
    slots = slots_ray.RaySlots(name, n)
    node = ray.get_runtime_context().get_node_id()
    held = []
    for _ in range(rounds):
        with slots:
            start = time.time()
            time.sleep(hold_s)
            held.append((node, start, time.time()))
    return held


def test_max_concurrent_holds_across_nodes(cluster):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    name = "slots:test-across"
    slots_ray.ensure_broker(name, 2)
    task = ray.remote(num_cpus=0)(_hammer)
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 3
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
            .remote(name, 2, 8, 0.02) for node in nodes for _ in range(2)]
    holds = [h for hs in ray.get(refs, timeout=120) for h in hs]
    assert {node for node, _, _ in holds} == set(nodes)
    stats = _stats(name)
    assert stats["grants"] == 6 * 8 and stats["in_use"] == 0 and stats["waiting"] == 0
    assert stats["peak"] == 2  # the actor's own count of holders never went above 2
    edges = sorted([(a, 1) for _, a, _ in holds] + [(b, -1) for _, _, b in holds])
    alive = peak = 0
    for _, d in edges:
        alive += d
        peak = max(peak, alive)
    assert peak <= 2  # the holders' own clocks agree (one machine, one clock)


def test_waiters_are_served_in_arrival_order(cluster):
    name = "slots:test-fifo"
    slots_ray.ensure_broker(name, 1)
    slots = slots_ray.RaySlots(name, 1)
    order: list[int] = []
    slots.acquire()

    def wait_then_note(i: int) -> None:
        with slots:
            order.append(i)

    threads = []
    for i in range(4):
        t = threading.Thread(target=wait_then_note, args=(i,))
        t.start()
        threads.append(t)
        deadline = time.monotonic() + 30
        while _stats(name)["waiting"] < i + 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # in line before the next one comes
    slots.release()
    for t in threads:
        t.join(timeout=30)
    assert order == [0, 1, 2, 3]
    assert slots.wait_s > 0


def test_timeout_leaves_the_line_and_misuse_raises(cluster):
    name = "slots:test-timeout"
    slots_ray.ensure_broker(name, 1)
    holder, waiter = slots_ray.RaySlots(name, 1), slots_ray.RaySlots(name, 1)
    assert holder.acquire()
    assert waiter.acquire(timeout=0.3) is False
    assert _stats(name)["waiting"] == 0
    waiter.timeout = 0.2
    with pytest.raises(TimeoutError, match=f"no API slot free in Ray actor {name}"), waiter:
        pass
    with pytest.raises(RuntimeError, match="not reentrant"):
        holder.acquire()
    holder.release()
    with pytest.raises(RuntimeError, match="holds no slot"):
        holder.release()
    assert waiter.acquire(timeout=5) is True
    waiter.release()


HOLDER = """
import sys, time
from retrain.slots.file_slots import slots_from_env
slots = slots_from_env()
slots.acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_sigkilled_holder_frees_its_slot_within_the_lease(cluster):
    name = "slots:test-dead"
    slots_ray.ensure_broker(name, 1)
    env = {**os.environ, ENV_VAR: f"ray:{name}:1", "RAY_ADDRESS": cluster.address}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        time.sleep(2 * slots_ray.HEARTBEAT_S)  # renewals keep a live holder's slot
        stats = _stats(name)
        assert stats["in_use"] == 1
        assert [slots_ray.holder_pid(h) for h in stats["holders"]] == [proc.pid]
        proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        proc.wait()
        waiter = slots_ray.RaySlots(name, 1)
        assert waiter.acquire(timeout=slots_ray.LEASE_S + 10)
        freed_after = time.monotonic() - killed
        waiter.release()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert freed_after <= slots_ray.LEASE_S + 2.0, freed_after
    stats = _stats(name)
    assert stats["expired"] == 1 and stats["holders"] == []


def test_slots_from_env_names_the_ray_actor(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "ray:slots:abc:3")
    slots = slots_from_env()
    assert isinstance(slots, slots_ray.RaySlots) and slots.name == "slots:abc"
    assert slots.max_concurrent == 3


def test_judge_slots_from_env_name_the_judge_actor_beside_the_api_one(monkeypatch, tmp_path):
    from retrain.slots.file_slots import CountingSemaphore, env_value
    from retrain.slots.judge_slots import judge_slots_from_env

    monkeypatch.setenv(ENV_VAR, "ray:slots:abc:3")
    judge = judge_slots_from_env(2)
    assert isinstance(judge, slots_ray.RaySlots) and judge.name == "judge-slots:abc"
    assert judge.max_concurrent == 2
    monkeypatch.setenv(ENV_VAR, env_value(tmp_path / "slots", 3))
    local = judge_slots_from_env(2)
    assert isinstance(local, CountingSemaphore) and local.where.endswith("judge_slots")
    monkeypatch.delenv(ENV_VAR)
    assert judge_slots_from_env(2) is None


KEEPS_HANDLER = """
import signal
from retrain.slots.file_slots import slots_from_env
def mine(signum, frame):
    pass
signal.signal(signal.SIGTERM, mine)
with slots_from_env():  # joins the cluster here, in the main thread
    pass
assert signal.getsignal(signal.SIGTERM) is mine, signal.getsignal(signal.SIGTERM)
print("kept")
"""


def test_joining_the_cluster_keeps_the_trainers_sigterm_handler(cluster):
    """ray.init installs its own SIGTERM handler; the trainer's (which checkpoints) must stay."""
    name = "slots:test-handler"
    slots_ray.ensure_broker(name, 1)
    env = {**os.environ, ENV_VAR: f"ray:{name}:1", "RAY_ADDRESS": cluster.address}
    done = subprocess.run([sys.executable, "-c", KEEPS_HANDLER], env=env, text=True,
                          capture_output=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "kept", done.stderr[-2000:]


def _hammer_until(name: str, stop: str, hold_s: float) -> list[tuple[float, float]]:
    """On one node: take and give back a slot until the file `stop` exists, reporting one
    completion per hold through the slots; (start, end) per hold."""
    slots = slots_ray.RaySlots(name, 64)
    held = []
    while not os.path.exists(stop):
        with slots:
            start = time.time()
            time.sleep(hold_s)
            held.append((start, time.time()))
        slots.record(completions=1, tokens=3)
    time.sleep(3 * slots_ray.HEARTBEAT_S)  # the heartbeat reports the last counts
    return held


def test_a_changing_cap_holds_across_nodes_and_usage_is_metered(cluster, tmp_path):
    """max_concurrent = "auto": the runner's controller resizes the actor while holders on
    three nodes hammer it; after each change, once the calls granted before it have ended,
    never more than the new cap hold a slot at once."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    name, hold_s = "slots:test-resize", 0.02
    slots_ray.ensure_broker(name, 4)
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    task = ray.remote(num_cpus=0)(_hammer_until)
    stop = tmp_path / "stop"
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
            .remote(name, str(stop), hold_s) for node in nodes for _ in range(3)]
    broker = slots_ray.find_broker(name)
    deadline = time.monotonic() + 120
    while _stats(name)["waiting"] < 3 and time.monotonic() < deadline:
        time.sleep(0.05)  # the holders are all up and queueing
    changes = []          # (just before the change, when it was in force, the new cap)
    for cap in (2, 5, 1, 3):
        time.sleep(1.0)
        before = time.time()
        ray.get(broker.resize.remote(cap))
        changes.append((before, time.time(), cap))
    time.sleep(1.0)
    end_at = time.time()
    stop.write_text("")
    holds = [h for hs in ray.get(refs, timeout=120) for h in hs]
    for k, (_, t_change, cap) in enumerate(changes):
        t_next = changes[k + 1][0] if k + 1 < len(changes) else end_at
        settled = t_change + hold_s + 0.2  # calls granted before the change have ended
        edges = sorted([(max(a, settled), 1) for a, b in holds if b > settled and a < t_next]
                       + [(b, -1) for a, b in holds if b > settled and a < t_next])
        alive = peak = 0
        for _, d in edges:
            alive += d
            peak = max(peak, alive)
        assert peak <= cap, (cap, peak)
        assert peak >= 1
    stats = _stats(name)
    usage = stats["usage"]
    assert stats["max_concurrent"] == 3 and usage["calls"] == stats["grants"] == len(holds)
    assert usage["completions"] == len(holds) and usage["tokens"] == 3 * len(holds)
    assert usage["held_s"] >= len(holds) * hold_s


def test_the_runner_controller_owns_the_actor_cap(cluster, tmp_path):
    """max_concurrent = "auto" with the Ray executor: the runner's controller sets the slot
    actor's cap and reads the usage the actor metered (RayCap)."""
    from retrain.campaign.concurrency import CampaignConcurrency, RayCap, read_decisions
    from retrain.config.sections import BackendConfig

    name = "slots:test-raycap"
    slots_ray.ensure_broker(name, 64)
    cc = CampaignConcurrency(tmp_path, BackendConfig(max_concurrent="auto"), 0.85, RayCap(name))
    cc.start()
    assert _stats(name)["max_concurrent"] == 4          # the controller's starting cap
    slots = slots_ray.RaySlots(name, 64)
    cc.tick(0.0)
    outer = 0.0  # the actor times a hold from its grant to its release: within the with-block
    for _ in range(5):
        t0 = time.monotonic()
        with slots:
            time.sleep(0.02)
        outer += time.monotonic() - t0
        slots.record(completions=2, tokens=6)
    time.sleep(3 * slots_ray.HEARTBEAT_S)
    cc.tick(100.0)
    (row,) = read_decisions(tmp_path)
    assert row["throughput"] == pytest.approx(5 / 100.0)
    assert row["completions_per_s"] == pytest.approx(10 / 100.0)
    rounding = 0.0005  # concurrency.jsonl keeps in_flight to 3 decimals
    assert 5 * 0.02 / 100.0 - rounding <= row["in_flight"] <= outer / 100.0 + rounding, \
        (row, outer)


def _peak(holds) -> int:
    edges = sorted([(a, 1) for _, a, _ in holds] + [(b, -1) for _, _, b in holds])
    alive = peak = 0
    for _, d in edges:
        alive += d
        peak = max(peak, alive)
    return peak


def test_the_cap_holds_across_a_restart_of_the_slot_actor(cluster):
    """Kill the slot actor while holders on every node take and give back slots: Ray restarts
    it empty; it grants nothing new until the holders re-register or their leases expire, so
    the holders' log of grants never shows more than the cap at once."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    name = "slots:test-restart"
    broker = slots_ray.ensure_broker(name, 2)
    task = ray.remote(num_cpus=0)(_hammer)
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
            .remote(name, 2, 3, 3.0) for node in nodes for _ in range(2)]
    deadline = time.monotonic() + 60
    while _stats(name)["grants"] < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    ray.kill(broker, no_restart=False)  # Ray restarts it, with an empty table
    holds = [h for hs in ray.get(refs, timeout=300) for h in hs]
    stats = _stats(name)
    assert stats["restarted"] and stats["reregistered"] >= 1, stats
    assert len(holds) == 6 * 3 and stats["in_use"] == 0
    assert stats["peak"] <= 2 and _peak(holds) <= 2, (stats, _peak(holds))


CALLER = """
import sys, time, urllib.request
from retrain.slots.file_slots import slots_from_env
slots = slots_from_env()
while True:
    with slots:  # one API call per slot, as the tinker backend makes them
        urllib.request.urlopen(sys.argv[1] + "/" + sys.argv[2], data=b"x").read()
    print("call", flush=True)
"""


class _Api:
    """A stand-in for the API: counts the calls it is serving at once, by caller."""

    def __init__(self):
        import http.server

        self.lock = threading.Lock()
        self.now = self.peak = 0
        self.calls: dict[str, int] = {}
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                with api.lock:
                    api.now += 1
                    api.peak = max(api.peak, api.now)
                    api.calls[self.path] = api.calls.get(self.path, 0) + 1
                time.sleep(0.1)
                with api.lock:
                    api.now -= 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_stalled_holder_learns_it_lost_the_slot_before_its_next_call(cluster):
    """Two real holders share one slot; one is SIGSTOPped for two leases (three times, at
    whatever point it is), typically while the actor grants it the slot, which then expires.
    On SIGCONT it must not call the API on that lost slot: the API never serves two calls
    at once, and the stalled holder goes on calling after it re-acquires."""
    name = "slots:test-stall"
    slots_ray.ensure_broker(name, 1)
    api = _Api()
    env = {**os.environ, ENV_VAR: f"ray:{name}:1", "RAY_ADDRESS": cluster.address}
    procs = {who: subprocess.Popen([sys.executable, "-c", CALLER, api.url, who], env=env,
                                   stdout=subprocess.DEVNULL) for who in ("a", "b")}
    try:
        deadline = time.monotonic() + 120
        while len(api.calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(api.calls) == 2, api.calls
        for _ in range(3):
            procs["a"].send_signal(signal.SIGSTOP)
            time.sleep(2 * slots_ray.LEASE_S + 0.5)
            before = api.calls["/a"]
            procs["a"].send_signal(signal.SIGCONT)
            deadline = time.monotonic() + 30
            while api.calls["/a"] <= before + 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert api.calls["/a"] > before + 2  # it went on calling
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
        api.server.shutdown()
    stats = _stats(name)
    assert stats["expired"] >= 1, stats  # a grant (or a hold) did expire while it stalled
    assert api.peak == 1, api.peak

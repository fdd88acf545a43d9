"""Fault-injection run (issue 28): one campaign of 4 runs survives four faults at once.

    python -m bench.faults                  # about 1.5 minutes on a loaded 2-core machine
    python -m bench.faults --steps 6 --delay-ms 200

The campaign: `executor = "ray"` on a one-machine Ray cluster that this script starts and
stops ($RAY_ADDRESS names it, so the runner joins it instead of starting a cluster of the
campaign's own, and this script can kill the slot actor), `backend = "tinker"` against a
`retrain serve` of `tiny-random` in this process (`--max-sessions 4`, `--delay-ms 100` so that
a request, during which its call holds the API slot, lasts long enough to be caught),
`max_concurrent = 2` (the slot actor). While it runs:
1. non-finite rewards: the reward function answers nan, inf or 1e39 for about a third of the
   completions (nan and inf are scored as failures; `reward_failures` counts them);
2. once every run has trained a step: one run's trainer (a tinker client) is SIGKILLed; its
   session at the server is freed by the heartbeat timeout; the campaign's first invocation
   then exits 1, and this script runs the same command again, which resumes it;
3. the slot actor is killed (Ray restarts it with an empty table);
4. another run's trainer is SIGSTOPped while it holds a slot (the slot actor lists its pid
   among the holders, before and a second after the stop), for two leases, then SIGCONTed;
   the actor must expire that lease (its expired-lease count goes up) meanwhile.
At the end it checks, and exits 1 when any check fails:
- every run's metrics.jsonl holds each step 1..N exactly once;
- no weights saved by the server (every checkpoint and sampler snapshot) hold NaN or inf;
- the cap held: the server never served more than `max_concurrent` API calls at once (its
  in-flight peak: the cap as the API saw it), and the slot actor's own peak (sampled while
  it lived) never went above it;
- the trainer stopped while holding a slot lost that lease (the actor expired it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

KEY = "tml-faults-bench-0123456789"
CAP = 2
RUNS = 4

REWARD = '''
import hashlib

def reward(completion: str, answer: str) -> float:
    """Digits are good; about a third of the completions get a non-finite (or huge) reward."""
    h = hashlib.sha1(completion.encode()).digest()[0] % 9
    if h == 0:
        return float("nan")
    if h == 1:
        return float("inf")
    if h == 2:
        return 1e39
    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))
'''


def campaign_toml(log_dir: Path, url: str, steps: int) -> str:
    return f"""
[model]
name = "tiny-random"
dtype = "float32"
threads = 1
lora_rank = 4
[data]
eval_size = 0
[reward]
type = "custom"
function = "reward.py:reward"
[training]
batch_size = 2
group_size = 4
max_tokens = 8
max_steps = {steps}
save_every = 1
lr = 0.03
[backend]
backend = "tinker"
base_url = "{url}"
max_concurrent = {CAP}
request_timeout_s = 120.0
[logging]
log_dir = "{log_dir}"
[campaign]
name = "faults"
seeds = {list(range(1, RUNS + 1))}
parallel = true
max_workers = {RUNS}
stagger_seconds = 0.0
max_retries = 1
executor = "ray"
"""


class Watch:
    """The campaign's run folders, their trainers' pids and step counts, and the slot actor."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.actor_peak = 0
        self.actor: dict = {}  # the slot actor's last stats

    def runs(self) -> list[Path]:
        return sorted(p.parent for p in self.folder.glob("*/config.toml"))

    @staticmethod
    def steps(run: Path) -> int:
        try:
            return len((run / "metrics.jsonl").read_text().splitlines())
        except OSError:
            return 0

    @staticmethod
    def pid(run: Path) -> int:
        """The pid of the run's trainer while it runs (0 otherwise: never signal a stale pid)."""
        try:
            state = json.loads((run / "state.json").read_text())
            pid = int(state.get("pid") or 0)
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes() if pid else b""
        except (OSError, ValueError):
            return 0
        return pid if state.get("status") == "running" and b"retrain" in cmdline else 0

    def broker(self):
        from retrain.campaign.ray_executor import campaign_key
        from retrain.slots import ray_slots as slots_ray

        return slots_ray.find_broker(slots_ray.broker_name(campaign_key(self.folder)))

    def sample_actor(self) -> None:
        import ray

        broker = self.broker()
        if broker is not None:
            with contextlib.suppress(ray.exceptions.RayError):  # restarting: sampled again soon
                self.actor = ray.get(broker.stats.remote(), timeout=10)
                self.actor_peak = max(self.actor_peak, self.actor["peak"])


def wait_until(what: str, predicate, watch: Watch, proc: subprocess.Popen,
               timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            raise SystemExit(f"the campaign ended before {what} (exit {proc.returncode}):\n"
                             + proc.log.read_text()[-3000:])
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        watch.sample_actor()
        time.sleep(0.2)


def inject(watch: Watch, proc: subprocess.Popen, steps: int, log) -> list[str]:
    """The faults, once every run has trained a step; returns the ones that could not be
    injected (a run already finished, no holder caught)."""
    import ray

    from retrain.slots import ray_slots as slots_ray

    wait_until("every run's first step", lambda: len(watch.runs()) == RUNS and all(
        watch.steps(r) >= 1 for r in watch.runs()), watch, proc)
    runs, missed = watch.runs(), []
    victim = watch.pid(runs[2])
    if victim and watch.steps(runs[2]) < steps:
        os.kill(victim, signal.SIGKILL)
        log(f"SIGKILL {runs[2].name} (a tinker client, pid {victim}) after step "
            f"{watch.steps(runs[2])}")
    else:
        missed.append(f"{runs[2].name} finished before it could be killed")
    watch.sample_actor()
    ray.kill(watch.broker(), no_restart=False)
    log(f"killed the slot actor (its peak so far: {watch.actor_peak})")
    caught = stop_a_holder(watch, [r for r in runs if r != runs[2]], steps, log)
    if caught is None:
        return [*missed, "no run's trainer was caught holding a slot"]
    holder, pid, expired_before = caught
    stopped, its_slots = time.monotonic(), {holder}
    while time.monotonic() < stopped + 2 * slots_ray.LEASE_S + 0.5:
        watch.sample_actor()
        its_slots.update(h for h in watch.actor.get("holders", [])
                         if slots_ray.holder_pid(h) == pid)
        time.sleep(0.2)
    held_still = holder in watch.actor.get("holders", [])
    expired = watch.actor.get("expired", 0) - expired_before
    log(f"after {2 * slots_ray.LEASE_S + 0.5:.1f} s stopped: the actor "
        f"{'still lists' if held_still else 'no longer lists'} the slot it was stopped "
        f"holding; {expired} lease(s) expired meanwhile; slots the actor listed for pid "
        f"{pid} while it was stopped (the one it held, and grants to its queued requests "
        f"that it could not see): {len(its_slots)}")
    os.kill(pid, signal.SIGCONT)
    log(f"SIGCONT pid {pid}")
    if held_still or expired < 1:
        missed.append(f"the stopped holder's lease did not expire ({holder})")
    return missed


def stop_a_holder(watch: Watch, runs: list[Path], steps: int, log,
                  timeout_s: float = 300) -> tuple[str, int, int] | None:
    """SIGSTOP a run's trainer while the slot actor lists it as a holder (its API slot is held
    only while one of its requests is on the wire). A second later, long before the lease
    can expire, the actor must still list it: it was stopped holding the slot (else it had
    just given the slot back: SIGCONT, and catch another). Returns (holder, pid, the actor's
    expired-lease count when it was stopped), or None."""
    from retrain.slots import ray_slots as slots_ray

    deadline = time.monotonic() + timeout_s
    tries = 0
    while time.monotonic() < deadline:
        trainers = {watch.pid(r): r for r in runs if watch.steps(r) < steps}
        trainers.pop(0, None)
        if not trainers:
            return None
        watch.sample_actor()
        holders = [h for h in watch.actor.get("holders", [])
                   if slots_ray.holder_pid(h) in trainers]
        if not holders:
            time.sleep(0.05)
            continue
        holder, pid = holders[0], slots_ray.holder_pid(holders[0])
        os.kill(pid, signal.SIGSTOP)
        tries += 1
        time.sleep(1.0)
        watch.sample_actor()
        if holder in watch.actor.get("holders", []):
            run = trainers[pid]
            log(f"SIGSTOP {run.name} (pid {pid}) for two leases, after step "
                f"{watch.steps(run)}, while it held slot {holder} (try {tries}; the actor "
                f"lists it 1 s after the stop: holders {watch.actor['holders']}, "
                f"{watch.actor['expired']} lease(s) expired so far)")
            return holder, pid, watch.actor["expired"]
        os.kill(pid, signal.SIGCONT)  # it gave the slot back just before the stop
    return None


def check(watch: Watch, steps: int, state_dir: Path, traffic_peak: int) -> list[str]:
    import math

    from safetensors.numpy import load_file

    problems = []
    for run in watch.runs():
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        if [r["step"] for r in rows] != list(range(1, steps + 1)):
            problems.append(f"{run.name}: steps {[r['step'] for r in rows]}")
    files = list(state_dir.rglob("*.safetensors"))
    bad = [f for f in files if any(not all(math.isfinite(x) for x in t.reshape(-1).tolist())
                                   for t in load_file(str(f)).values())]
    problems += [f"non-finite weights in {f}" for f in bad]
    if not files:
        problems.append(f"no weights were saved under {state_dir}")
    if traffic_peak > CAP:
        problems.append(f"the server served {traffic_peak} calls at once (cap {CAP})")
    if watch.actor_peak > CAP:
        problems.append(f"the slot actor granted {watch.actor_peak} slots at once (cap {CAP})")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--delay-ms", type=float, default=100.0,
                    help="added to every API request by the server (as `retrain serve "
                         "--delay-ms`)")
    args = ap.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    from retrain.backends.models import TINY, resolve_model
    from retrain.serve.local_engine import LocalEngine
    from retrain.serve.server import ServerThread
    from retrain.serve.tinker.routes import build_app

    t0 = time.monotonic()

    def log(text: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {text}", flush=True)

    os.environ["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    resolve_model(TINY)  # built once, before anything is timed
    engine = LocalEngine.load(TINY, dtype="float32")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        state_dir = tmp / "serve-state"
        app, _ = build_app(engine, state_dir, api_key=KEY, max_sessions=RUNS,
                           delay_s=args.delay_ms / 1000.0)
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": RUNS, "object_store_memory": 80 * 2**20, "include_dashboard": False})
        try:
            ray.init(address=cluster.address, namespace="retrain", log_to_driver=False)
            with ServerThread(app) as server:
                (tmp / "reward.py").write_text(REWARD)
                (tmp / "faults.toml").write_text(campaign_toml(tmp / "logs", server.url,
                                                               args.steps))
                env = {**os.environ, "RAY_ADDRESS": cluster.address, "TINKER_API_KEY": KEY,
                       "TINKER_TELEMETRY": "0"}
                command = [sys.executable, "-m", "retrain", "faults.toml"]
                watch = Watch(tmp / "logs" / "faults")
                log("campaign started")
                out = (tmp / "campaign.log").open("w")
                proc = subprocess.Popen(command, cwd=tmp, env=env, stdout=out,
                                        stderr=subprocess.STDOUT, text=True)
                proc.log = tmp / "campaign.log"  # type: ignore[attr-defined]
                missed = inject(watch, proc, args.steps, log)
                while proc.poll() is None:
                    watch.sample_actor()
                    time.sleep(0.5)
                log(f"campaign ended, exit {proc.returncode}; running the same command again")
                again = subprocess.run(command, cwd=tmp, env=env, capture_output=True,
                                       text=True, timeout=900)
                log(f"second run ended, exit {again.returncode}")
                if again.returncode != 0:
                    print(again.stderr[-3000:], file=sys.stderr)
                failures = sum(max(json.loads(line).get("reward_failures") or 0 for line in
                                   (run / "metrics.jsonl").read_text().splitlines())
                               for run in watch.runs())  # a running count per run
                problems = missed + check(watch, args.steps, state_dir, app.traffic.peak)
                log(f"{RUNS} runs x {args.steps} steps; server in-flight peak "
                    f"{app.traffic.peak} calls, slot actor peak {watch.actor_peak} (cap {CAP}); "
                    f"{failures} non-finite rewards scored as failures")
                a = watch.actor
                log(f"slot actor after its restart: restarted={a.get('restarted')}, "
                    f"{a.get('reregistered')} holder(s) re-registered, {a.get('expired')} "
                    f"lease(s) expired, {a.get('grants')} grants")
        finally:
            ray.shutdown()
            cluster.shutdown()
    for p in problems:
        print(f"FAIL: {p}")
    print("OK: every step exactly once, all weights finite, cap never exceeded"
          if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

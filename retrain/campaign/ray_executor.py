"""The Ray executor: each run is one detached, named Ray actor that starts the same worker
process as the local executor (`python -m retrain run <config>`) on the node Ray picked.

- Placement: the actor asks for the run's resources (`[campaign] run_resources`, per rank: a
  run of N ranks asks N times them, so its worker's N processes share one node and see the N
  GPUs Ray gave the actor), so Ray puts it where they are free; the runner still caps runs in
  flight (counting ranks) and spaces launches.
- Node loss: the actor dies with its node; the worker notices (`lost = True`) and the runner
  starts the run again elsewhere, where the trainer resumes from its last checkpoint.
- Runner loss: actors are detached and named `run:<campaign key>:<run>:<attempt>`, so a new
  runner finds the ones still running and watches them instead of starting a second copy.
- The worker process dies with its actor (PR_SET_PDEATHSIG), so a killed actor leaves no
  orphan writing into the run folder.
- No cluster running: the campaign starts one on this machine that outlives its runner
  (`ray_cluster`), reused by the next runner and stopped when the campaign's runs are done.

Ray is imported here only; the runner imports this module only when executor = "ray".
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from retrain.campaign import ray_address, ray_cluster
from retrain.campaign.executor import Job
from retrain.campaign.plan import CampaignPlan, run_resources
from retrain.config.distributed_section import ranks
from retrain.config.judge_section import JudgeConfig, judge_config
from retrain.config.sections import Config
from retrain.errors import UserError
from retrain.slots import ray_slots as slots_ray
from retrain.slots.judge_slots import judge_actor_name

NAMESPACE = slots_ray.NAMESPACE
FORWARDED_ENV = ("RETRAIN_", "TINKER_", "HF_", "WANDB_")  # the driver's settings workers need
SHARED_CHECK_TIMEOUT_S = 60.0
STOP_WAIT_S = 10.0
PREVIOUS_ATTEMPT_WAIT_S = 120.0


class RunProcess:
    """The actor: hosts one run's worker process and reports how it ended."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.started = asyncio.Event()

    async def start(self, config_path: str, log_path: str, env: dict[str, str],
                    command: list[str] | None = None) -> dict:
        """Start `<command> <config>` (default: this node's `python -m retrain run`)."""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        await _previous_attempt_gone(Path(config_path).parent, log_path)
        command = command or [sys.executable, "-m", "retrain", "run"]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*command, config_path],
                cwd=str(Path(config_path).parent), env=full_env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_die_with_parent)
        self.started.set()
        return await self.info()

    async def info(self) -> dict:
        import ray

        return {"pid": self.proc.pid if self.proc else 0, "host": socket.gethostname(),
                "node": ray.get_runtime_context().get_node_id()}

    async def wait(self) -> int:
        """The worker's exit status (negative: the signal that killed it)."""
        await self.started.wait()
        while self.proc.poll() is None:
            await asyncio.sleep(0.05)
        return self.proc.returncode

    async def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signum)


async def _previous_attempt_gone(run_dir: Path, log_path: str) -> None:
    """Wait while the run's last worker is still alive on this host (its node's raylet died but
    it has not noticed yet), so two attempts never write one run folder at once."""
    from retrain.runfiles import runlog

    deadline = time.monotonic() + PREVIOUS_ATTEMPT_WAIT_S
    waited = False
    while time.monotonic() < deadline:
        state = runlog.load_state(run_dir)
        if not (state and state.status == "running" and state.pid != os.getpid()
                and runlog.pid_alive(state.pid, state.host)):
            break
        waited = True
        await asyncio.sleep(0.2)
    if waited:
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"(waited {PREVIOUS_ATTEMPT_WAIT_S - deadline + time.monotonic():.1f}s "
                      "for the previous attempt's process on this host to exit)\n")


def _die_with_parent() -> None:
    """In the child: get SIGKILL when the actor process dies (Linux; elsewhere a no-op)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class RayWorker:
    """A run started (or found still running) on the cluster."""

    def __init__(self, actor: Any, info_ref: Any, name: str):
        self.actor, self.name = actor, name
        self._info_ref = info_ref
        self._done_ref = actor.wait.remote()
        self._info: dict | None = None
        self._code: int | None = None
        self.lost = False   # the actor (its node, or its process) died: not the run's fault

    @property
    def pid(self) -> int:
        info = self.placement()
        return int(info["pid"]) if info else 0

    def placement(self) -> dict | None:
        """{'pid', 'host', 'node'} once Ray has started the run, else None."""
        import ray

        if self._info is None:
            ready, _ = ray.wait([self._info_ref], timeout=0)
            if ready:
                try:
                    self._info = ray.get(self._info_ref)
                except ray.exceptions.RayError:
                    return None
        return self._info

    def poll(self) -> int | None:
        import ray

        if self._code is not None:
            return self._code
        ready, _ = ray.wait([self._done_ref], timeout=0)
        if not ready:
            return None
        try:
            self._code = int(ray.get(self._done_ref))
        except ray.exceptions.RayError:
            self.lost, self._code = True, -signal.SIGKILL
        self.placement()
        ray.kill(self.actor, no_restart=True)  # frees its resources and its name
        return self._code

    def terminate(self) -> None:
        self.actor.signal.remote(signal.SIGTERM)

    def kill(self) -> None:
        import ray

        try:
            ray.get(self.actor.signal.remote(signal.SIGKILL), timeout=STOP_WAIT_S)
            ray.wait([self._done_ref], timeout=STOP_WAIT_S)
        except ray.exceptions.RayError:
            pass
        self.poll()
        ray.kill(self.actor, no_restart=True)


class RayExecutor:
    """Launches runs as Ray actors on the cluster at `address` ('' = auto, else start one)."""

    def __init__(self, campaign_dir: Path, cfg: Config, plan: CampaignPlan,
                 command: list[str] | None = None):
        self.campaign_dir = Path(campaign_dir)
        self.cfg, self.plan = cfg, plan
        self.command = command  # None: `python -m retrain run` with each node's own Python
        self.key = campaign_key(self.campaign_dir)
        self.broker_name = slots_ray.broker_name(self.key)
        self.cpu, self.gpu = self._resources(0.0)
        self.own_cluster: ray_cluster.OwnCluster | None = None  # one this campaign started

    def _resources(self, cluster_gpus: float) -> tuple[float, float]:
        res = run_resources(self.cfg, self.plan, cluster_gpus)
        return res["cpu"], res["gpu"]

    # -- set-up, called by the runner before anything is launched
    def prepare(self, max_concurrent: int) -> None:
        import ray

        try:
            self._join()
        except ConnectionError as exc:
            raise UserError(f"[campaign] executor = \"ray\": {exc}") from None
        try:
            self.cpu, self.gpu = self._resources(ray.cluster_resources().get("GPU", 0.0))
            check_shared_storage(self.campaign_dir)
            slots_ray.ensure_broker(self.broker_name, max_concurrent)
            judge = self._judge()
            if judge is not None:  # the judge's budget, shared by the runs on every node
                slots_ray.ensure_broker(judge_actor_name(self.broker_name), judge.max_concurrent)
        except BaseException:
            self._stop_own_cluster()  # nothing was launched on it
            raise

    def _judge(self) -> JudgeConfig | None:
        return judge_config(self.cfg.reward) if self.cfg.reward.type == "judge" else None

    def _join(self) -> None:
        """Connect to the configured cluster; without one, to this campaign's own (started by
        an earlier runner, whose runs may still be going), else to the cluster running on
        this machine, else to a new one of the campaign's own (`ray_cluster`: it outlives
        this runner)."""
        if slots_ray.explicit_address(self.plan.ray_address) not in ray_address.KEYWORDS:
            slots_ray.connect(self.plan.ray_address)
            return
        own = ray_cluster.recorded(self.campaign_dir)
        if own is None:
            try:
                slots_ray.connect(self.plan.ray_address)
                return
            except ConnectionError:
                own = ray_cluster.start(self.campaign_dir, self.key)
        self.own_cluster = own
        own.use_auth_mode()
        slots_ray.connect(own.address)

    def worker_env(self, max_concurrent: int) -> dict[str, str]:
        """What every run's process gets: the slot actor, the cluster, the driver's settings."""
        import ray

        from retrain.machine.cpu import AUTO_THREADS_ENV
        from retrain.slots.file_slots import ENV_VAR, RAY_PREFIX

        env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}
        env[ENV_VAR] = f"{RAY_PREFIX}{self.broker_name}:{max_concurrent}"
        env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        env[AUTO_THREADS_ENV] = str(max(1, int(self.cpu)))  # threads = 0: the cores it asked for
        judge = self._judge()
        if judge is not None and judge.api_key_env in os.environ:  # as TINKER_API_KEY is
            env[judge.api_key_env] = os.environ[judge.api_key_env]
        return env

    def launch(self, job: Job) -> RayWorker:
        attempt = getattr(job, "attempt", 0)
        # A runner killed between launching and saving the manifest left this attempt running.
        running = self.adopt(job.name, attempt)
        if running is not None:
            return running
        name, ranks = run_actor_name(self.key, job.name, attempt), getattr(job, "ranks", 1)
        actor = _actor_class().options(
            name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=self.cpu * ranks,
            num_gpus=self.gpu * ranks, max_restarts=0, max_concurrency=8).remote()
        job.log_path.parent.mkdir(parents=True, exist_ok=True)
        info_ref = actor.start.remote(str(job.config_path), str(job.log_path), dict(job.env),
                                      self.command)
        return RayWorker(actor, info_ref, name)

    def adopt(self, name: str, attempt: int) -> RayWorker | None:
        """The actor of `name`'s attempt still running on the cluster, if any."""
        import ray

        actor_name = run_actor_name(self.key, name, attempt)
        try:
            actor = ray.get_actor(actor_name, namespace=NAMESPACE)
            info_ref = actor.info.remote()
            ray.get(info_ref, timeout=STOP_WAIT_S)
        except (ValueError, ray.exceptions.RayError):
            return None
        return RayWorker(actor, info_ref, actor_name)

    def close(self, finished: bool) -> None:
        """At the end: drop the slot actors (API, judge) once no run of this campaign can use
        them, and stop the campaign's own cluster unless other actors are on it."""
        import ray

        if not finished:
            return
        for name in (self.broker_name, judge_actor_name(self.broker_name)):
            broker = slots_ray.find_broker(name)
            if broker is not None:
                ray.kill(broker, no_restart=True)
        self._stop_own_cluster()

    def _stop_own_cluster(self) -> None:
        import ray

        own, self.own_cluster = self.own_cluster, None
        if own is None:
            return
        others = [a for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") != NAMESPACE or self.key not in a.get("name", "")]
        if others:  # a campaign pointed at its address, or someone's actors: left running
            return
        ray.shutdown()
        ray_cluster.stop(self.campaign_dir, own)


def _actor_class() -> Any:
    import ray

    return ray.remote(RunProcess)


def campaign_key(campaign_dir: Path) -> str:
    """A short stable id of a campaign folder, used in actor names."""
    return hashlib.sha1(str(Path(campaign_dir).resolve()).encode()).hexdigest()[:12]


def run_actor_name(key: str, run: str, attempt: int) -> str:
    return f"run:{key}:{run}:{attempt}"


def describe_cluster(cfg: Config, plan: CampaignPlan,
                     campaign_dir: Path | None = None) -> tuple[str, int | None]:
    """For `explain`: the reachable cluster's resources and how many runs fit on it at once
    (None when Ray is missing or no cluster answers; nothing is started). Without a
    configured address, the campaign's own cluster comes first, as for the run."""
    named = slots_ray.explicit_address(plan.ray_address) not in ray_address.KEYWORDS
    own = None if named or campaign_dir is None else ray_cluster.recorded(campaign_dir)
    try:
        import ray

        if own is not None:
            own.use_auth_mode()
        slots_ray.connect(own.address if own is not None else plan.ray_address)
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    except ConnectionError as exc:
        if named:  # the run would stop here too: say so now, in one line
            raise UserError(f"[campaign] executor = \"ray\": {exc}") from None
        return "no cluster running; the campaign starts one on this machine", None
    except Exception as exc:  # no Ray: explain goes on without it
        return f"no cluster reachable ({type(exc).__name__})", None
    per_rank = run_resources(cfg, plan, sum(n.get("GPU", 0.0) for n in nodes))
    res = {k: v * ranks(cfg.distributed) for k, v in per_rank.items()}  # "auto": 1 (a CPU)
    fits = sum(_fits(n, res) for n in nodes)
    cpus, gpus = sum(n.get("CPU", 0.0) for n in nodes), sum(n.get("GPU", 0.0) for n in nodes)
    text = (f"{len(nodes)} node(s), {cpus:g} CPU, {gpus:g} GPU; each run asks "
            f"cpu = {res['cpu']:g}, gpu = {res['gpu']:g}")
    if own is not None:
        text = f"the campaign's own cluster at {own.address} (started by its runner), {text}"
    return text, fits


def _fits(node: dict[str, float], res: dict[str, float]) -> int:
    counts = [int(node.get(key.upper(), 0.0) // need) for key, need in res.items() if need > 0]
    return min(counts) if counts else 0


def _read_marker(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        return f"error: {exc.strerror or exc}"


def check_shared_storage(folder: Path) -> None:
    """Every alive node must see `folder`: a marker written here is read back by a task pinned
    to each node. Raises UserError naming the folder, the nodes and the fix otherwise."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = uuid.uuid4().hex
    marker = Path(folder) / f".shared-check-{token[:8]}"
    marker.write_text(token)
    try:
        read = ray.remote(num_cpus=0, max_retries=0)(_read_marker)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        refs = {n["NodeManagerHostname"] + f" ({n['NodeID'][:8]})": read.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(str(marker)) for n in nodes}
        bad = []
        for where, ref in refs.items():
            try:
                seen = ray.get(ref, timeout=SHARED_CHECK_TIMEOUT_S)
            except ray.exceptions.RayError as exc:
                seen = f"error: {type(exc).__name__}"
            if seen != token:
                bad.append(f"{where}: {seen if seen.startswith('error') else 'another file'}")
    finally:
        marker.unlink(missing_ok=True)
    if bad:
        raise UserError(f"{folder}: logging.log_dir is not shared with every Ray node; a file "
                        "written here could not be read back on:\n  - " + "\n  - ".join(bad)
                        + "\nPut logging.log_dir on storage every node mounts at the same path "
                        "(NFS or similar), or run with executor = \"local\".")

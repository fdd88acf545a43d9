"""Run a campaign: one worker process per run, stagger, manifest, resume, clean shutdown.

Every run is a normal single run (`python -m retrain run <run>/config.toml`) in its own
process, so a crash never takes the campaign down. The runner only schedules, watches and
records; the trainer resumes an unfinished run folder by itself.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from retrain import config_file, runlog, toml_io
from retrain.campaign import executor as ex
from retrain.campaign.manifest import Manifest, RunEntry, load_manifest, save_manifest
from retrain.campaign.matrix import RunSpec, expand, matrix_hash, run_config_for, safe_name
from retrain.campaign.plan import CampaignPlan
from retrain.config import Config, ConfigError
from retrain.config_paths import anchor_paths
from retrain.cpu import AUTO_THREADS_ENV, available_cores
from retrain.errors import UserError
from retrain.slots import ENV_VAR, env_value

GRACE_S = 60.0          # how long stopped workers get to checkpoint before SIGKILL
TICK_S = 0.005          # scheduler poll interval after an event (a waitpid per worker) ...
MAX_TICK_S = 0.1        # ... backing off to this while nothing happens
PROGRESS_EVERY_S = 2.0  # how often running runs' last_step is copied into the manifest
TAIL_LINES = 15
SLOTS_DIR = "slots"
LOCK_FILE = ".runner.lock"
WORKER_LOG = "worker.log"
NEXT_CONFIG_FILE = "config.next.toml"


@dataclass
class PlannedRun:
    """A run of the matrix with its resolved config and folder."""

    spec: RunSpec
    config: Config
    run_dir: Path

    @property
    def config_path(self) -> Path:
        return self.run_dir / runlog.CONFIG_FILE


def run_campaign(cfg: Config, campaign: CampaignPlan, config_path: str | Path, new: bool = False,
                 force: bool = False, *, executor: ex.Executor | None = None) -> int:
    """Run (or resume) every run of `campaign` over the base run `cfg`; returns the
    exit status."""
    config_path = Path(config_path).resolve()
    try:
        specs = expand(cfg, campaign)
    except ConfigError as exc:
        raise ConfigError(str(config_path), exc.issues) from None
    root = Path(cfg.logging.log_dir).expanduser().resolve()
    name = safe_name(campaign.name or config_path.stem, "campaign")
    campaign_dir = locate_campaign(root, name, new=new)
    campaign_dir.mkdir(parents=True, exist_ok=True)
    with runner_lock(campaign_dir):
        executor = executor or executor_for(cfg, campaign, campaign_dir)
        if hasattr(executor, "prepare"):  # e.g. Ray: join the cluster, check shared storage
            executor.prepare(cfg.backend.max_concurrent)
        plans = [PlannedRun(s, anchor_paths(run_config_for(cfg, s, campaign_dir),
                                            config_path.parent), campaign_dir / s.name)
                 for s in specs]
        manifest, adopted = prepare_manifest(cfg, campaign, config_path, campaign_dir, plans,
                                             force, executor)
        runner = Runner(cfg, campaign, campaign_dir, plans, manifest, executor)
        return runner.run(adopted)


def executor_for(cfg: Config, campaign: CampaignPlan, campaign_dir: Path) -> ex.Executor:
    """The executor `[campaign] executor` names (Ray is imported only when chosen)."""
    if campaign.executor != "ray":
        return ex.LocalExecutor()
    try:
        import ray  # noqa: F401
    except ImportError:
        raise UserError("[campaign] executor = \"ray\" needs Ray: pip install 'retrain[ray]' "
                        "(or set executor = \"local\")") from None
    from retrain.campaign.ray_executor import RayExecutor

    return RayExecutor(campaign_dir, cfg, campaign)


# ---------------------------------------------------------------------------- campaign folder


def locate_campaign(root: Path, name: str, new: bool) -> Path:
    """The newest `<name>` or `<name>-<k>` folder under root; with `new`, the next free one."""
    pattern = re.compile(re.escape(name) + r"(?:-(\d+))?")
    found = {1 if m.group(1) is None else int(m.group(1))
             for p in (root.iterdir() if root.is_dir() else ())
             if p.is_dir() and (m := pattern.fullmatch(p.name))}
    found.discard(0)
    if not found:
        return root / name
    k = max(found) + 1 if new else max(found)
    return root / (name if k == 1 else f"{name}-{k}")


@contextmanager
def runner_lock(campaign_dir: Path) -> Iterator[None]:
    """One runner per campaign folder at a time (a flock: a killed runner frees it)."""
    fd = os.open(campaign_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            old = load_manifest(campaign_dir)
            who = f" (runner pid {old.runner.get('pid')})" if old and old.runner else ""
            raise UserError(f"{campaign_dir} is already being run by another runner{who}; "
                            "wait for it, stop it, or start a fresh campaign with --new") from None
        yield
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- manifest


def prepare_manifest(cfg: Config, campaign: CampaignPlan, config_path: Path, campaign_dir: Path,
                     plans: list[PlannedRun], force: bool, executor: object = None
                     ) -> tuple[Manifest, dict[str, ex.Worker]]:
    """Load or create the manifest, refuse a changed matrix unless forced, and reconcile
    runs left 'running' by a runner that died. Returns it with any still-live workers."""
    new_hash = matrix_hash({p.spec.name: p.config for p in plans})
    old = load_manifest(campaign_dir)
    if old is None:
        if (campaign_dir / runlog.STATE_FILE).exists():
            raise UserError(f"{campaign_dir} holds a single run, not a campaign; set "
                            "[campaign].name to another name, or use --new")
        manifest = Manifest(campaign=campaign_dir.name, config_file=str(config_path),
                            config_hash=new_hash)
        manifest.runs = [_new_entry(p) for p in plans]
    else:
        changes = describe_changes(old, plans, new_hash)
        if changes and not force:
            raise UserError(f"{config_path}: the campaign matrix changed since "
                            f"{campaign_dir / runlog.MANIFEST_FILE} was written:\n  - "
                            + "\n  - ".join(changes) + "\nRun with --new to start a fresh "
                            "campaign, or --force to continue this one with the new matrix "
                            "(finished runs are kept; a raised training.max_steps continues them).")
        manifest = _merge(old, plans, new_hash)
    _describe_campaign(manifest, cfg, campaign, config_path, campaign_dir)
    adopted = _reconcile(manifest, plans, executor)
    save_manifest(campaign_dir, manifest)
    return manifest, adopted


def _new_entry(plan: PlannedRun) -> RunEntry:
    s = plan.spec
    return RunEntry(name=s.name, condition=s.condition, seed=s.seed, overrides=s.overrides,
                    log_dir=s.name, max_steps=plan.config.training.max_steps)


def _merge(old: Manifest, plans: list[PlannedRun], new_hash: str) -> Manifest:
    """Keep the history of runs still in the matrix; retire (never delete) the others."""
    by_name = {r.name: r for r in old.runs}
    runs = []
    for p in plans:
        entry = by_name.pop(p.spec.name, None) or _new_entry(p)
        entry.condition, entry.seed = p.spec.condition, p.spec.seed
        entry.overrides, entry.max_steps = p.spec.overrides, p.config.training.max_steps
        entry.log_dir = p.spec.name
        if entry.status == "completed" and entry.last_step < entry.max_steps:
            entry.status = "pending"  # training.max_steps was raised: continue the run
        runs.append(entry)
    old.runs = runs
    old.retired_runs = old.retired_runs + list(by_name.values())
    old.config_hash = new_hash
    return old


def _describe_campaign(manifest: Manifest, cfg: Config, c: CampaignPlan, config_path: Path,
                       campaign_dir: Path | None = None) -> None:
    manifest.config_file = str(config_path)
    manifest.runner = {"pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time()}
    manifest.status = "running"
    manifest.parallel, manifest.max_workers = c.parallel, c.max_workers
    manifest.stagger_seconds = c.stagger_seconds
    manifest.max_concurrent, manifest.slots_dir = cfg.backend.max_concurrent, SLOTS_DIR
    manifest.executor, manifest.ray_address = c.executor, c.ray_address
    if c.executor == "ray":
        from retrain.campaign.ray_executor import campaign_key
        from retrain.slots_ray import broker_name

        manifest.slots_dir, manifest.slots_actor = "", broker_name(campaign_key(campaign_dir))
    manifest.conditions = list(dict.fromkeys(r.condition for r in manifest.runs))
    manifest.seeds = list(dict.fromkeys(r.seed for r in manifest.runs))


def describe_changes(old: Manifest, plans: list[PlannedRun], new_hash: str) -> list[str]:
    """What differs between the manifest's matrix and the new one, in words (empty: nothing)."""
    old_runs = {r.name: r for r in old.runs}
    new_names = [p.spec.name for p in plans]
    lines = []
    added = [n for n in new_names if n not in old_runs]
    removed = [n for n in old_runs if n not in set(new_names)]
    if added:
        lines.append("new runs: " + _some(added))
    if removed:
        lines.append("runs no longer in the matrix: " + _some(removed))
    for p in plans:
        entry = old_runs.get(p.spec.name)
        if entry is not None and entry.overrides != p.spec.overrides:
            lines.append(f"{p.spec.name}: overrides {entry.overrides} -> {p.spec.overrides}")
    if old.config_hash != new_hash:
        key_lines = _key_changes(plans)
        lines += key_lines or [f"the resolved run configs changed (hash {old.config_hash} -> "
                               f"{new_hash})"]
    return lines


def _key_changes(plans: list[PlannedRun]) -> list[str]:
    """Key-by-key differences between each run's config.toml on disk and its new config."""
    diffs: dict[tuple[str, str, str], int] = {}
    for p in plans:
        try:
            before = toml_io.loads(p.config_path.read_text())
        except (OSError, ValueError):
            continue
        for key, (old, new) in config_file.diff(before, config_file.to_dict(p.config)).items():
            if key != "logging.log_dir":
                change = (key, _show(old), _show(new))
                diffs[change] = diffs.get(change, 0) + 1
    return [f"{k}: {a} -> {b} ({n} run{'s' if n > 1 else ''})"
            for (k, a, b), n in diffs.items()]


def _show(value: object) -> str:
    return "(unset)" if value is None else toml_io.format_value(value)


def _some(names: list[str], limit: int = 6) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _reconcile(manifest: Manifest, plans: list[PlannedRun],
               executor: object = None) -> dict[str, ex.Worker]:
    """Runs a dead runner left 'running': adopt the live workers, mark the rest interrupted.
    Runs whose state.json says completed are completed (their runner died before noting it)."""
    adopted: dict[str, ex.Worker] = {}
    for plan in plans:
        entry = manifest.entry(plan.spec.name)
        if entry is None:
            continue
        if entry.status == "running":
            worker = _still_running(executor, entry, plan)
            if worker is not None:
                adopted[entry.name] = worker
                continue
            entry.status = "interrupted"
        state = runlog.load_state(plan.run_dir)
        if (entry.status != "completed" and state is not None and state.status == "completed"
                and state.step >= entry.max_steps):
            entry.status, entry.exit_code = "completed", 0
            _record_progress(entry, plan.run_dir, final=True)
    return adopted


def _still_running(executor: object, entry: RunEntry, plan: PlannedRun) -> ex.Worker | None:
    """The live worker of a run left 'running', found the executor's way (Ray: by actor name)."""
    if hasattr(executor, "adopt"):
        return executor.adopt(entry.name, entry.attempts)
    if ex.is_worker_of(entry.pid, plan.config_path):
        return ex.AdoptedWorker(entry.pid, plan.config_path)
    return None


def _record_placement(entry: RunEntry, worker: ex.Worker) -> bool:
    """Copy where the worker runs (Ray: host, node, pid) into the entry once it is known."""
    where = worker.placement() if hasattr(worker, "placement") else None
    if not where or (entry.node == where["node"] and entry.pid == where["pid"]):
        return False
    entry.host, entry.node, entry.pid = where["host"], where["node"], int(where["pid"])
    entry.placements.append({"attempt": entry.attempts, "host": entry.host,
                             "node": entry.node, "pid": entry.pid})
    return True


def _record_progress(entry: RunEntry, run_dir: Path, final: bool = False) -> bool:
    """Copy the run's last step (and, at the end, its last metrics row) into the entry."""
    state = runlog.load_state(run_dir)
    changed = False
    if state is not None and state.step != entry.last_step:
        entry.last_step, changed = state.step, True
    if final:
        rows = runlog.read_metrics(run_dir / runlog.METRICS_FILE).rows
        if rows:
            last = dict(rows[-1])
            evals = [r["eval_accuracy"] for r in rows if r.get("eval_accuracy") is not None]
            if evals:
                last["eval_accuracy"] = evals[-1]
            entry.final_metrics = last
            if state is None and isinstance(last.get("step"), int):
                entry.last_step = last["step"]
        changed = True
    return changed


# ---------------------------------------------------------------------------- scheduling


class _Stop:
    """Signal flags set by the handlers; the scheduler loop acts on them."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.hard = False

    def __call__(self, signum: int, _frame: object) -> None:
        if self.signum is None:
            self.signum = signum
        else:
            self.hard = True  # a second Ctrl-C: stop waiting for checkpoints


class Runner:
    """Schedules the runs of one campaign and keeps its manifest up to date."""

    def __init__(self, cfg: Config, c: CampaignPlan, campaign_dir: Path,
                 plans: list[PlannedRun], manifest: Manifest, executor: ex.Executor):
        self.dir = campaign_dir
        self.plans = {p.spec.name: p for p in plans}
        self.manifest = manifest
        self.executor = executor
        self.max_retries = c.max_retries
        n = len(plans)
        self.max_workers = (c.max_workers or n) if c.parallel else 1
        self.stagger = c.stagger_seconds if c.parallel else 0.0
        self.env = {ENV_VAR: env_value(campaign_dir / SLOTS_DIR, cfg.backend.max_concurrent),
                    **thread_share_env(cfg, min(self.max_workers, n))}
        if hasattr(executor, "worker_env"):  # Ray: the slot actor instead of a local folder
            self.env = executor.worker_env(cfg.backend.max_concurrent)
        self.alive: dict[str, ex.Worker] = {}
        self.todo: list[RunEntry] = []
        self.stop = _Stop()
        self.t0 = time.monotonic()

    def run(self, adopted: dict[str, ex.Worker]) -> int:
        self.alive.update(adopted)
        for name in adopted:
            self.say(f"{name}: still running from a previous runner (pid {adopted[name].pid}); "
                     "watching it")
        todo = self.todo = [e for e in self.manifest.runs if self._wants_run(e)]
        gave_up = [e for e in self.manifest.runs if e.status == "failed" and not self._wants_run(e)]
        done = sum(e.status == "completed" for e in self.manifest.runs)
        self.say(f"campaign {self.manifest.campaign}: {len(self.manifest.runs)} runs, "
                 f"{done} completed, "
                 f"{len(todo)} to run" + (f", {len(gave_up)} failed too often (max_retries = "
                                          f"{self.max_retries})" if gave_up else "")
                 + f"; manifest {self.dir / runlog.MANIFEST_FILE}")
        with self._signals():
            self._schedule(todo)
            if self.stop.signum is not None:
                self._shutdown()
        return self._finish()

    def _wants_run(self, e: RunEntry) -> bool:
        if e.status in ("pending", "interrupted"):
            return True
        return e.status == "failed" and e.failures <= self.max_retries

    def _schedule(self, todo: list[RunEntry]) -> None:
        next_launch = 0.0
        next_progress = time.monotonic() + PROGRESS_EVERY_S
        tick = TICK_S  # grows while nothing happens, so a long campaign costs ~no CPU
        while (todo or self.alive) and self.stop.signum is None:
            if self._reap():
                tick = TICK_S
            now = time.monotonic()
            if todo and len(self.alive) < self.max_workers and now >= next_launch:
                self._launch(todo.pop(0))
                # Counted from after the spawn, so recorded start times are >= stagger apart
                # however long writing the run's config and log header took.
                next_launch = time.monotonic() + self.stagger
                tick = TICK_S
                continue
            if now >= next_progress:
                next_progress = now + PROGRESS_EVERY_S
                self._progress()
            wait = tick
            if todo and len(self.alive) < self.max_workers:
                wait = min(wait, max(0.0, next_launch - now))
            time.sleep(wait)
            tick = min(tick * 1.5, MAX_TICK_S)

    def _launch(self, entry: RunEntry) -> None:
        plan = self.plans[entry.name]
        config_path = write_run_config(plan)
        log_path = plan.run_dir / WORKER_LOG
        entry.attempts += 1
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"\n=== attempt {entry.attempts} of {entry.name} at "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')} ===\n")
        entry.started_at, entry.ended_at, entry.exit_code = time.time(), None, None
        worker = self.executor.launch(ex.Job(entry.name, config_path, log_path, self.env,
                                             attempt=entry.attempts))
        entry.status, entry.pid, entry.error = "running", worker.pid, ""
        self.alive[entry.name] = worker
        self._save()
        where = f"Ray actor {worker.name}" if hasattr(worker, "placement") else f"pid {worker.pid}"
        self.say(f"start {entry.name} (attempt {entry.attempts}, {where})")

    def _reap(self, stopping: bool = False) -> bool:
        """Record every worker that has ended; True if any had."""
        reaped = False
        for name, worker in list(self.alive.items()):
            code = worker.poll()
            if code is None:
                continue
            del self.alive[name]
            reaped = True
            entry = self.manifest.entry(name)
            assert entry is not None
            plan = self.plans[name]
            state = runlog.load_state(plan.run_dir)
            entry.exit_code, entry.ended_at = code, time.time()
            entry.status = _outcome(code, state, stopping)
            if getattr(worker, "adopted", False) and code not in (0, 1):
                entry.status = "interrupted"  # it died with the old runner: resume it
                if not stopping:
                    self.todo.append(entry)
            _record_progress(entry, plan.run_dir, final=True)
            if entry.status == "failed":
                entry.failures += 1
                entry.error = log_tail(plan.run_dir / WORKER_LOG)
            self._retry_if_lost(entry, worker, stopping)
            self._save()
            took = entry.ended_at - (entry.started_at or entry.ended_at)
            detail = "" if entry.status == "completed" else f", {describe_exit(code)}"
            self.say(f"{name} {entry.status} at step {entry.last_step}/{entry.max_steps} "
                     f"in {took:.1f}s{detail}")
        return reaped

    def _retry_if_lost(self, entry: RunEntry, worker: ex.Worker, stopping: bool) -> None:
        """A run whose Ray actor died (its node left) starts again elsewhere, now, while it
        has retries left; it resumes from its last checkpoint."""
        _record_placement(entry, worker)
        if not getattr(worker, "lost", False) or entry.status != "failed":
            return
        entry.error = f"its Ray actor died on {entry.host or 'an unknown host'} " \
                      f"(node {entry.node[:12] or '?'} lost or process killed)\n" + entry.error
        if not stopping and entry.failures <= self.max_retries:
            self.say(f"{entry.name}: its node or actor died; retrying on another node "
                     f"(failure {entry.failures} of max_retries = {self.max_retries} + 1)")
            self.todo.append(entry)

    def _progress(self) -> None:
        changed = [_record_progress(self.manifest.entry(n), self.plans[n].run_dir)
                   for n in self.alive]
        changed += [_record_placement(self.manifest.entry(n), w) for n, w in self.alive.items()]
        if any(changed):
            self._save()

    def _shutdown(self) -> None:
        """Forward SIGTERM, give workers GRACE_S to checkpoint, then SIGKILL the rest."""
        sig = signal.Signals(self.stop.signum).name
        if self.alive:
            self.say(f"{sig}: asking {len(self.alive)} worker(s) to checkpoint and stop "
                     f"(up to {GRACE_S:.0f}s; press Ctrl-C again to kill them now)")
        for worker in self.alive.values():
            worker.terminate()
        deadline = time.monotonic() + GRACE_S
        while self.alive and time.monotonic() < deadline and not self.stop.hard:
            self._reap(stopping=True)
            time.sleep(TICK_S)
        for worker in self.alive.values():
            worker.kill()
        self._reap(stopping=True)
        for name in list(self.alive):  # killed but not yet reaped (adopted pids)
            entry = self.manifest.entry(name)
            entry.status, entry.ended_at = "interrupted", time.time()
        self.alive.clear()

    def _finish(self) -> int:
        counts = self.manifest.counts()
        if self.stop.signum is not None:
            self.manifest.status = "interrupted"
        elif counts["failed"]:
            self.manifest.status = "failed"
        elif counts["completed"] == len(self.manifest.runs):
            self.manifest.status = "completed"
        else:
            self.manifest.status = "interrupted"
        self._save()
        if hasattr(self.executor, "close"):
            self.executor.close(finished=not self.alive)
        print(summary(self.manifest, self.dir), flush=True)
        if self.stop.signum is not None:
            return 128 + self.stop.signum
        return 0 if self.manifest.status == "completed" else 1

    @contextmanager
    def _signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
        old = {s: signal.signal(s, self.stop) for s in sigs}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    def _save(self) -> None:
        save_manifest(self.dir, self.manifest)

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {text}", flush=True)


def write_run_config(plan: PlannedRun) -> Path:
    """Write the config file the worker runs, and return its path.

    Normally `<run>/config.toml`. A run that already made progress under a different config
    (possible after --force) gets `<run>/config.next.toml` instead, so the trainer can compare
    it with the config.toml it started from and refuse a change that would mix experiments.
    """
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    target = plan.config_path
    state = runlog.load_state(plan.run_dir)
    if state is not None and state.step > 0 and target.exists():
        try:
            same = config_file.loads_config(target.read_text(encoding="utf-8")) == plan.config
        except (OSError, ConfigError):
            same = False
        if not same:
            target = plan.run_dir / NEXT_CONFIG_FILE
    runlog.replace_atomically(target, config_file.dumps_config(plan.config).encode("utf-8"))
    return target


def _outcome(code: int, state: runlog.RunState | None, stopping: bool) -> str:
    """completed | failed | interrupted, from the exit status and the run's own state.json."""
    if code == 0 or (state is not None and state.status == "completed"):
        return "completed"
    if stopping:
        return "interrupted"
    if state is not None and state.status == "interrupted" and code in (130, 143, -2, -15):
        return "interrupted"  # someone stopped this worker on purpose; it checkpointed
    return "failed"


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def log_tail(path: Path, lines: int = TAIL_LINES, max_chars: int = 4000) -> str:
    """The last lines of the latest attempt in a worker log."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    text = text.rsplit("\n=== attempt ", 1)[-1]
    tail = "\n".join(text.rstrip("\n").splitlines()[1:][-lines:])
    return tail[-max_chars:]


# ---------------------------------------------------------------------------- summary


def summary(manifest: Manifest, campaign_dir: Path) -> str:
    """The final table: one line per run, then the tail of each failed run's log."""
    counts = manifest.counts()
    parts = [f"{n} {s}" for s, n in counts.items() if n]
    lines = [f"\ncampaign {manifest.campaign} ({campaign_dir}): {len(manifest.runs)} runs: "
             + ", ".join(parts)]
    header = ("run", "status", "tries", "steps", "mean_reward", "correct_rate", "time")
    rows = [header]
    for r in manifest.runs:
        took = (r.ended_at - r.started_at) if r.started_at and r.ended_at else None
        rows.append((r.name, r.status, str(r.attempts), f"{r.last_step}/{r.max_steps}",
                     _num(r.final_metrics.get("mean_reward")),
                     _num(r.final_metrics.get("correct_rate")),
                     f"{took:.1f}s" if took is not None else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
              for row in rows]
    for r in manifest.runs:
        if r.status == "failed":
            lines.append(f"\n{r.name} failed ({describe_exit(r.exit_code)}, attempt "
                         f"{r.attempts}); last lines of {campaign_dir / r.log_dir / WORKER_LOG}:")
            lines += ["    " + ln for ln in (r.error or "(empty log)").splitlines()]
    if counts["failed"]:
        lines.append(f"\n{counts['failed']} run(s) failed; run the same command again to "
                     "retry them (up to [campaign].max_retries extra attempts each)")
    if counts["interrupted"] or counts["pending"]:
        lines.append("\nrun the same command again to resume the unfinished runs")
    return "\n".join(lines)


def _num(x: object) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


def thread_share_env(cfg: Config, workers: int) -> dict[str, str]:
    """Split the cores between local workers that run at once (each `threads = 0` worker).

    Oversubscribed torch threads spin-wait for each other: measured on 2 cores, a second
    busy process made a 2-thread SmolLM2 sampling step 10x slower, a 1-thread one not at all.
    """
    if cfg.backend.backend != "local" or workers <= 1:
        return {}
    return {AUTO_THREADS_ENV: str(max(1, available_cores() // workers))}

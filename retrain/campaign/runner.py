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
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from retrain.campaign import executor as ex
from retrain.campaign.budget import BoundOf, CampaignBudget
from retrain.campaign.concurrency import CampaignConcurrency, FileCap, RayCap
from retrain.campaign.manifest import (
    SLOTS_DIR,
    WORKER_LOG,
    Manifest,
    RunEntry,
    load_manifest,
    save_manifest,
)
from retrain.campaign.matrix import expand, run_config_for, safe_name
from retrain.campaign.plan import CampaignPlan
from retrain.campaign.race_plan import race_of, resolution
from retrain.campaign.race_runs import RaceKeeper, check_resume, check_runs, keeper_for
from retrain.campaign.report import describe_exit, log_tail, summary
from retrain.campaign.run_records import (
    PlannedRun,
    prepare_manifest,
    record_placement,
    record_progress,
    write_run_config,
)
from retrain.campaign.seats import capacity, check_ranks, fits, run_ranks, thread_share_env
from retrain.config.paths import anchor_paths
from retrain.config.sections import Config, ConfigError, run_config
from retrain.errors import UserError
from retrain.runfiles import runlog
from retrain.slots.file_slots import ENV_VAR, clear_cap, env_value

GRACE_S = 60.0          # how long stopped workers get to checkpoint before SIGKILL
TICK_S = 0.005          # scheduler poll interval after an event (a waitpid per worker) ...
MAX_TICK_S = 0.1        # ... backing off to this while nothing happens
PROGRESS_EVERY_S = 2.0  # how often running runs' last_step is copied into the manifest
LOCK_FILE = ".runner.lock"


def run_campaign(cfg: Config, campaign: CampaignPlan, config_path: str | Path, new: bool = False,
                 force: bool = False, *, executor: ex.Executor | None = None,
                 bound_of: BoundOf | None = None) -> int:
    """Run (or resume) every run of `campaign` over the base run `cfg`; returns the
    exit status. `bound_of`: a run's upper bound, for the [campaign] budget's check."""
    config_path = Path(config_path).resolve()
    try:
        specs = expand(cfg, campaign)
    except ConfigError as exc:
        raise ConfigError(str(config_path), exc.issues) from None
    root = Path(cfg.logging.log_dir).expanduser().resolve()
    name = safe_name(campaign.name or config_path.stem, "campaign")
    campaign_dir = locate_campaign(root, name, new=new)
    race = race_of(campaign.race)
    if race is not None:  # a metric the runs do not produce: refused before anything is made
        check_runs(race, {s.condition: run_config_for(cfg, s, campaign_dir) for s in specs},
                   str(config_path))
    check_ranks(campaign, {s.name: run_config_for(cfg, s, campaign_dir) for s in specs},
                str(config_path))
    campaign_dir.mkdir(parents=True, exist_ok=True)
    with runner_lock(campaign_dir):
        executor = executor or executor_for(cfg, campaign, campaign_dir)
        concurrency = concurrency_for(cfg, campaign_dir, executor)
        if hasattr(executor, "prepare"):  # e.g. Ray: join the cluster, check shared storage
            executor.prepare(concurrency.cap if concurrency else cfg.backend.slot_count)
        plans = [PlannedRun(s, anchor_paths(run_config_for(cfg, s, campaign_dir),
                                            config_path.parent), campaign_dir / s.name)
                 for s in specs]
        check_resume(load_manifest(campaign_dir), campaign.race, force, str(config_path),
                     specs)
        manifest, adopted = prepare_manifest(cfg, campaign, config_path, campaign_dir, plans,
                                             force, executor)
        keeper = keeper_for(race, manifest, {p.spec.name: p.run_dir for p in plans},
                            campaign.max_retries,
                            resolution(race, {p.spec.condition: p.config for p in plans})
                            if race else 0.0)
        runner = Runner(cfg, campaign, campaign_dir, plans, manifest, executor, concurrency,
                        keeper, bound_of)
        return runner.run(adopted)


def concurrency_for(cfg: Config, campaign_dir: Path,
                    executor: ex.Executor) -> CampaignConcurrency | None:
    """The campaign's concurrency controller under max_concurrent = "auto" (None when fixed:
    a cap file left by an earlier auto campaign is removed)."""
    slots_dir = campaign_dir / SLOTS_DIR
    if not cfg.backend.auto_concurrency:
        clear_cap(slots_dir)
        return None
    owner = RayCap(executor.broker_name) if hasattr(executor, "broker_name") \
        else FileCap(slots_dir)
    return CampaignConcurrency(campaign_dir, cfg.backend, cfg.backpressure.throttle_margin,
                               owner)


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
                 plans: list[PlannedRun], manifest: Manifest, executor: ex.Executor,
                 concurrency: CampaignConcurrency | None = None, race: RaceKeeper | None = None,
                 bound_of: BoundOf | None = None):
        self.dir = campaign_dir
        self.race = race
        self.plans = {p.spec.name: p for p in plans}
        self.manifest = manifest
        self.executor = executor
        self.max_retries = c.max_retries
        self.ranks = {p.spec.name: run_ranks(p.config) for p in plans}  # ranks of each run
        self.max_workers = capacity(c, list(self.ranks.values()))  # ranks alive at once
        self.stagger = c.stagger_seconds if c.parallel else 0.0
        self.env = {ENV_VAR: env_value(campaign_dir / SLOTS_DIR, cfg.backend.slot_count),
                    **thread_share_env(cfg, min(self.max_workers, sum(self.ranks.values())))}
        if hasattr(executor, "worker_env"):  # Ray: the slot actor instead of a local folder
            self.env = executor.worker_env(cfg.backend.slot_count)
        self.concurrency = concurrency
        self.budget = CampaignBudget(cfg, c, [p.run_dir for p in plans], bound_of)
        self.alive: dict[str, ex.Worker] = {}
        self.todo: list[RunEntry] = []
        self.stop = _Stop()
        self.t0 = time.monotonic()

    def run(self, adopted: dict[str, ex.Worker]) -> int:
        self.alive.update(adopted)
        for name in adopted:
            self.say(f"{name}: still running from a previous runner (pid {adopted[name].pid}); "
                     "watching it")
        todo = self.todo = [e for e in self.manifest.runs if self._wants_run(e)
                            and (self.race is None or self.race.released(e))]
        gave_up = [e for e in self.manifest.runs if e.status == "failed" and not self._wants_run(e)]
        done = sum(e.status == "completed" for e in self.manifest.runs)
        raced = "" if self.race is None else f" (race: {self.race.progress()})"
        self.say(f"campaign {self.manifest.campaign}: {len(self.manifest.runs)} runs{raced}, "
                 f"{done} completed, "
                 f"{len(todo)} to run" + (f", {len(gave_up)} failed too often (max_retries = "
                                          f"{self.max_retries})" if gave_up else "")
                 + f"; manifest {self.dir / runlog.MANIFEST_FILE}")
        if self.concurrency is not None:
            self.concurrency.start()
            self.say(f"API concurrency auto: cap {self.concurrency.cap}"
                     + (f", {self.concurrency.resumed}" if self.concurrency.resumed else "")
                     + f"; decisions in {self.dir / 'concurrency.jsonl'}")
        with self._signals():
            self._schedule(todo)
            if self.stop.signum is not None:
                self._shutdown()
        return self._finish()

    def _wants_run(self, e: RunEntry) -> bool:
        if e.status in ("pending", "interrupted", runlog.BUDGET):  # budget: when it was raised
            return True
        return e.status == "failed" and e.failures <= self.max_retries

    def _schedule(self, todo: list[RunEntry]) -> None:
        next_launch = 0.0
        next_progress = time.monotonic() + PROGRESS_EVERY_S
        tick = TICK_S  # grows while nothing happens, so a long campaign costs ~no CPU
        while self.stop.signum is None:
            if not todo and not self.alive and not self._next_round(todo):
                break
            if self._reap():
                tick = TICK_S
            now = time.monotonic()
            if self._room(todo) and now >= next_launch:
                self._launch(todo.pop(0))
                # Counted from after the spawn, so recorded start times are >= stagger apart
                # however long writing the run's config and log header took.
                next_launch = time.monotonic() + self.stagger
                tick = TICK_S
                continue
            if now >= next_progress:
                next_progress = now + PROGRESS_EVERY_S
                self._progress()
            if self.concurrency is not None:
                self._tune_concurrency()
            wait = tick
            if self._room(todo):
                wait = min(wait, max(0.0, next_launch - now))
            time.sleep(wait)
            tick = min(tick * 1.5, MAX_TICK_S)

    def _room(self, todo: list[RunEntry]) -> bool:
        """Whether the next run's ranks fit beside those of the runs alive (`seats`)."""
        return bool(todo) and fits(self.ranks[todo[0].name],
                                   [self.ranks.get(n, 1) for n in self.alive], self.max_workers)

    def _next_round(self, todo: list[RunEntry]) -> bool:
        """A race's next decision once its released runs have ended; True if it released
        more runs (recorded in the manifest before any of them starts)."""
        if self.race is None:
            return False
        fresh, lines = self.race.next_round()
        for line in lines:
            self.say(line)
        if lines:
            self._save()
        todo.extend(fresh)
        return bool(fresh)

    def _launch(self, entry: RunEntry) -> None:
        plan = self.plans[entry.name]
        if why := self.budget.refusal(plan.config, plan.run_dir):  # [campaign] budget_*
            entry.status = runlog.BUDGET
            self._save()
            self.say(f"{entry.name}: not started: {why}")
            return
        plan.config = run_config(plan.config, **self.budget.handed(plan.config, plan.run_dir))
        config_path = write_run_config(plan)
        log_path = plan.run_dir / WORKER_LOG
        entry.attempts += 1
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"\n=== attempt {entry.attempts} of {entry.name} at "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')} ===\n")
        entry.started_at, entry.ended_at, entry.exit_code = time.time(), None, None
        entry.status, entry.pid, entry.error = "running", 0, ""
        self._save()  # before the start: a runner killed in between leaves a trace to adopt
        worker = self.executor.launch(ex.Job(entry.name, config_path, log_path, self.env,
                                             attempt=entry.attempts,
                                             ranks=self.ranks[entry.name]))
        entry.pid = worker.pid
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
            record_progress(entry, plan.run_dir, final=True)
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
        record_placement(entry, worker)
        if not getattr(worker, "lost", False) or entry.status != "failed":
            return
        entry.error = f"its Ray actor died on {entry.host or 'an unknown host'} " \
                      f"(node {entry.node[:12] or '?'} lost or process killed)\n" + entry.error
        if not stopping and entry.failures <= self.max_retries:
            self.say(f"{entry.name}: its node or actor died; retrying on another node "
                     f"(failure {entry.failures} of max_retries = {self.max_retries} + 1)")
            self.todo.append(entry)

    def _tune_concurrency(self) -> None:
        """One decision of the campaign's concurrency controller, when one is due."""
        old = self.concurrency.cap
        try:
            decision = self.concurrency.tick()
        except Exception as exc:  # a lost Ray actor, a full disk: the cap stays, runs go on
            self.say(f"API concurrency: no decision this interval ({exc})")
            return
        if decision is not None and decision.cap != old:
            self.say(f"API concurrency: cap {old} -> {decision.cap}: {decision.reason}")

    def _progress(self) -> None:
        changed = [record_progress(self.manifest.entry(n), self.plans[n].run_dir)
                   for n in self.alive]
        changed += [record_placement(self.manifest.entry(n), w) for n, w in self.alive.items()]
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
        elif counts[runlog.BUDGET]:
            self.manifest.status = runlog.BUDGET
        elif counts["completed"] + counts["skipped"] == len(self.manifest.runs):
            self.manifest.status = "completed"
        else:
            self.manifest.status = "interrupted"
        self._save()
        if hasattr(self.executor, "close"):
            self.executor.close(finished=not self.alive)
        print(summary(self.manifest, self.dir), flush=True)
        if self.stop.signum is not None:
            return 128 + self.stop.signum
        if self.manifest.status == runlog.BUDGET:
            return runlog.BUDGET_EXIT
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


def _outcome(code: int, state: runlog.RunState | None, stopping: bool) -> str:
    """completed | failed | interrupted, from the exit status and the run's own state.json."""
    if code == 0 or (state is not None and state.status == "completed"):
        return "completed"
    if state is not None and state.status == runlog.BUDGET:
        return runlog.BUDGET  # stopped at its budget, checkpointed: resumed when it is raised
    if stopping:
        return "interrupted"
    if state is not None and state.status == "interrupted" and code in (130, 143, -2, -15):
        return "interrupted"  # someone stopped this worker on purpose; it checkpointed
    return "failed"

"""The manifest's bookkeeping for a campaign's runs: plan each run (config and folder), create
or merge the manifest (refusing a changed matrix unless forced, in words), adopt or mark the
runs a dead runner left, copy progress, and write the config file each worker runs.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from retrain.bill.tally import Tally
from retrain.campaign import executor as ex
from retrain.campaign.manifest import (
    SLOTS_DIR,
    Manifest,
    RunEntry,
    load_manifest,
    save_manifest,
)
from retrain.campaign.matrix import RunSpec, matrix_hash
from retrain.campaign.plan import CampaignPlan
from retrain.config import loader as config_file
from retrain.config import toml_io
from retrain.config.sections import Config, ConfigError
from retrain.errors import UserError
from retrain.runfiles import runlog

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
        if entry.status == "completed" and entry.last_step < entry.max_steps + \
                _sft_steps(p.run_dir):
            entry.status = "pending"  # training.max_steps was raised: continue the run
        runs.append(entry)
    old.runs = runs
    old.retired_runs = old.retired_runs + list(by_name.values())
    old.config_hash = new_hash
    return old


def _sft_steps(run_dir: Path) -> int:
    """The [sft] steps a run took before its RL steps (its state says; 0 without)."""
    state = runlog.load_state(run_dir)
    steps = state.extra.get("sft_steps", 0) if state is not None else 0
    return steps if isinstance(steps, int) and steps > 0 else 0


def _describe_campaign(manifest: Manifest, cfg: Config, c: CampaignPlan, config_path: Path,
                       campaign_dir: Path | None = None) -> None:
    manifest.config_file = str(config_path)
    manifest.runner = {"pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time()}
    manifest.status = "running"
    manifest.parallel, manifest.max_workers = c.parallel, c.max_workers
    manifest.stagger_seconds = c.stagger_seconds
    manifest.max_concurrent, manifest.slots_dir = cfg.backend.slot_count, SLOTS_DIR
    manifest.executor, manifest.ray_address = c.executor, c.ray_address
    if c.executor == "ray":
        from retrain.campaign.ray_executor import campaign_key
        from retrain.slots.ray_slots import broker_name

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
        key_lines, all_read = _key_changes(plans)
        order = order_changes(old, [p.spec for p in plans]) if not lines else []
        if not key_lines and not all_read:
            key_lines = order or [f"the resolved run configs changed (hash {old.config_hash} "
                                  f"-> {new_hash})"]
        lines += key_lines
    return lines


def order_changes(old: Manifest, specs: list) -> list[str]:
    """The seeds or conditions, the same ones, in another order (the run hash covers the order,
    and a race takes seeds in it), in words; [] when neither was reordered."""
    lines = []
    for what, before, now in (("seed", old.seeds, [s.seed for s in specs]),
                              ("condition", old.conditions, [s.condition for s in specs])):
        now = list(dict.fromkeys(now))
        if before != now and sorted(map(str, before)) == sorted(map(str, now)):
            lines.append(f"{what} order: {', '.join(map(str, before))} -> "
                         f"{', '.join(map(str, now))}")
    return lines


def _key_changes(plans: list[PlannedRun]) -> tuple[list[str], bool]:
    """Key-by-key differences between each run's config.toml on disk and its new config, and
    whether every config.toml could be read. A key that a newer retrain added at its default
    is no change: upgrading retrain must not make a campaign's matrix look changed."""
    diffs: dict[tuple[str, str, str], int] = {}
    defaults = config_file.flat_defaults()
    all_read = True
    for p in plans:
        try:
            before = toml_io.loads(p.config_path.read_text())
        except (OSError, ValueError):
            all_read = False
            continue
        for key, (old, new) in config_file.diff(before, config_file.to_dict(p.config)).items():
            added_at_default = old is None and key in defaults and new == defaults[key]
            if key != "logging.log_dir" and not added_at_default:
                change = (key, _show(old), _show(new))
                diffs[change] = diffs.get(change, 0) + 1
    return [f"{k}: {a} -> {b} ({n} run{'s' if n > 1 else ''})"
            for (k, a, b), n in diffs.items()], all_read


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
            record_progress(entry, plan.run_dir, final=True)
    return adopted


def _still_running(executor: object, entry: RunEntry, plan: PlannedRun) -> ex.Worker | None:
    """The live worker of a run left 'running', found the executor's way (Ray: by actor name)."""
    if hasattr(executor, "adopt"):
        return executor.adopt(entry.name, entry.attempts)
    if entry.pid and ex.is_worker_of(entry.pid, plan.config_path):
        return ex.AdoptedWorker(entry.pid, plan.config_path)
    # A runner killed between starting a worker and recording its pid: find it by its config.
    found = ex.find_worker([plan.config_path, plan.run_dir / NEXT_CONFIG_FILE])
    return ex.AdoptedWorker(*found) if found else None


def record_placement(entry: RunEntry, worker: ex.Worker) -> bool:
    """Copy where the worker runs (Ray: host, node, pid) into the entry once it is known."""
    where = worker.placement() if hasattr(worker, "placement") else None
    if not where or (entry.node == where["node"] and entry.pid == where["pid"]):
        return False
    entry.host, entry.node, entry.pid = where["host"], where["node"], int(where["pid"])
    entry.placements.append({"attempt": entry.attempts, "host": entry.host,
                             "node": entry.node, "pid": entry.pid})
    return True


def record_progress(entry: RunEntry, run_dir: Path, final: bool = False) -> bool:
    """Copy the run's last step (and, at the end, its last metrics row) into the entry."""
    state = runlog.load_state(run_dir)
    changed = False
    if state is not None and state.step != entry.last_step:
        entry.last_step, changed = state.step, True
    if state is not None and state.max_steps > entry.max_steps:  # its [sft] steps count too
        entry.max_steps, changed = state.max_steps, True
    if final:
        rows = runlog.read_metrics(run_dir / runlog.METRICS_FILE).rows
        if rows:
            last = dict(rows[-1])
            evals = [r["eval_accuracy"] for r in rows if r.get("eval_accuracy") is not None]
            if evals:
                last["eval_accuracy"] = evals[-1]
            entry.final_metrics = last
            entry.spent = Tally.of_rows(rows).as_dict()
            if state is None and isinstance(last.get("step"), int):
                entry.last_step = last["step"]
        changed = True
    return changed


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

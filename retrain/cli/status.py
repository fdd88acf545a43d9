"""`retrain status [LOGDIR]`: scan a logs folder and summarise its runs and campaigns.

Read-only and tolerant: torn metrics lines are skipped (and counted), unreadable files show
as unknown values, and nothing here can change a run's files.
"""

from __future__ import annotations

import math
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrain.config import toml_io
from retrain.control import capacity
from retrain.errors import UserError
from retrain.results.spent import Bill, run_bill, total
from retrain.runfiles import runlog, safejson

# A run that says "running" but whose process cannot be checked (another host) is stale
# after this long without an update, or after 5 median steps, whichever is longer.
STALE_AFTER_S = 600.0
STATES = ("running", "completed", "failed", "stale", "pending", "interrupted", "budget",
          "skipped", "unreadable")
# What state.json and manifest.json may say: status shows the same word (plus "stale").
_FILE_STATES = frozenset(runlog.RUN_STATUSES)


@dataclass
class RunStatus:
    name: str
    path: str
    state: str
    step: int = 0
    max_steps: int | None = None
    mean_reward: float | None = None
    mean_turns: float | None = None      # environments: model turns per episode
    median_step_time_s: float | None = None
    tokens_per_second: float | None = None
    max_token_hit_rate: float | None = None
    bp_action: str | None = None
    bp_regime: str | None = None
    bp_p_star: float | None = None       # the last USL fit's p* (None: no fit or unbounded)
    bp_throughput: float | None = None   # the controller's smoothed tokens/s
    plot: str | None = None        # the run's back-pressure picture, once drawn
    bad_lines: int = 0
    updated_at: float | None = None
    error: str = ""
    condition: str | None = None   # campaign runs only
    seed: int | None = None
    attempts: int | None = None
    exit_code: int | None = None
    node: str | None = None        # Ray campaigns: host (node id) of the current attempt
    bill: Bill = field(default_factory=Bill)  # tokens and cost spent (docs/cost.md)


@dataclass
class CampaignStatus:
    name: str
    path: str
    state: str
    conditions: list[str]
    seeds: list[int]
    runs: list[RunStatus]
    counts: dict[str, int]
    steps_left: int
    time_left_s: float | None
    api_slots_in_use: int | None
    max_concurrent: int | None
    api_cap: int | None = None     # max_concurrent = "auto": the controller's current cap ...
    api_cap_reason: str = ""       # ... and its last decision's reason
    parallel: bool = False
    max_workers: int = 0
    problem: str = ""              # why manifest.json could not be read (its runs still show)
    race: dict = field(default_factory=dict)  # [campaign.race]: manifest.json's race
    bill: Bill = field(default_factory=Bill)  # its runs' bills summed


@dataclass
class StatusReport:
    logdir: str
    runs: list[RunStatus] = field(default_factory=list)
    campaigns: list[CampaignStatus] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    message: str = ""


# ---------------------------------------------------------------------------- scanning


def scan(logdir: str | Path, now: float | None = None) -> StatusReport:
    """Every run and campaign at or below `logdir`."""
    root = Path(logdir)
    now = time.time() if now is None else now
    report = StatusReport(logdir=str(root))
    if not root.exists():
        report.message = (f"{root}: no such folder yet. Runs write there once started "
                          "(`retrain quickstart.toml`); or give the folder: `retrain status DIR`")
        return report
    if not root.is_dir():
        raise UserError(f"{root} is a file, not a logs folder; try `retrain status logs`")
    run_dirs, campaign_dirs = runlog.walk_logs(root)
    report.campaigns = [_campaign_or_why(c, now, run_dirs) for c in campaign_dirs]
    inside = [Path(c.path) for c in report.campaigns]
    report.runs = [_run_or_why(r, root, now) for r in run_dirs
                   if not any(r != c and c in r.parents for c in inside)]
    report.counts = count_states(report.runs)
    if not report.runs and not report.campaigns:
        report.message = (f"{root}: no runs or campaigns yet. Start one with "
                          "`retrain init` and `retrain quickstart.toml`")
    return report


def count_states(runs: list[RunStatus]) -> dict[str, int]:
    """Runs per state, in the fixed order of STATES, zeros left out."""
    counts = {s: sum(1 for r in runs if r.state == s) for s in STATES}
    return {s: n for s, n in counts.items() if n}


def _run_or_why(folder: Path, root: Path | None, now: float) -> RunStatus:
    """scan_run; a run whose files break it shows as "unreadable" with the reason, so that
    one bad run never hides the others."""
    try:
        return scan_run(folder, root, now)
    except Exception as exc:  # noqa: BLE001 (whatever it is, the other runs still show)
        return RunStatus(name=_run_name(folder, root), path=str(folder), state="unreadable",
                         error=f"{type(exc).__name__}: {exc}"[:300])


def _run_name(folder: Path, root: Path | None) -> str:
    return str(folder.relative_to(root)) if root and folder != root else folder.name


def scan_run(folder: Path, root: Path | None = None, now: float | None = None) -> RunStatus:
    """Summarise one run folder from its state.json, metrics.jsonl and config.toml."""
    now = time.time() if now is None else now
    name = _run_name(folder, root)
    state = _load_state(folder)
    metrics = runlog.read_metrics(folder / runlog.METRICS_FILE)
    rows = metrics.rows
    run = RunStatus(name=name, path=str(folder), state="pending", bad_lines=metrics.bad_lines)
    run.median_step_time_s = capacity.median_step_time(r.get("step_time_s") for r in rows)
    steps = [r["step"] for r in rows if _is_int(r.get("step"))]
    run.step = max([*steps, _int(state.get("step"), 0), 0])
    run.max_steps = max(_int(state.get("max_steps"), 0), 0) or _config_max_steps(folder)
    run.mean_reward = _last(rows, "mean_reward")
    run.mean_turns = _last(rows, "mean_turns")
    run.tokens_per_second = _last(rows, "tokens_per_second")
    run.max_token_hit_rate = _last(rows, "max_token_hit_rate")
    run.bp_action = _last(rows, "bp_action", str)
    run.bp_regime = _last(rows, "bp_regime", str)
    last_bp = next((r for r in reversed(rows) if isinstance(r.get("bp_regime"), str)), None)
    if last_bp is not None:  # the latest decision's values (p* is null while unbounded)
        run.bp_p_star = _float(last_bp.get("bp_p_star"))
        run.bp_throughput = _float(last_bp.get("bp_throughput"))
    if (folder / runlog.PLOT_FILE).is_file():
        run.plot = str(folder / runlog.PLOT_FILE)
    run.error = str(state.get("error") or "")[:500]
    run.bill = run_bill(folder, rows)
    run.updated_at = _updated_at(folder, state)
    run.state = _run_state(run, state, now)
    return run


def _run_state(run: RunStatus, state: dict, now: float) -> str:
    status = _text(state.get("status"))
    if status in _FILE_STATES and status != "running":
        return status
    if not state and run.max_steps and run.step >= run.max_steps:
        return "completed"  # metrics only, and they reached the end
    if status == "running" or (not state and run.step > 0):
        return "running" if _alive(state, run, now) else "stale"
    return "pending"


def _alive(state: dict, run: RunStatus, now: float) -> bool:
    """The process is checked when it ran on this host; otherwise the last update's age."""
    pid, host = _int(state.get("pid"), 0), str(state.get("host") or "")
    if pid > 0 and (not host or host == socket.gethostname()):
        return runlog.pid_alive(pid)
    limit = max(STALE_AFTER_S, 5 * (run.median_step_time_s or 0))
    return run.updated_at is not None and now - run.updated_at < limit


def _load_state(folder: Path) -> dict:
    return runlog.read_json(folder / runlog.STATE_FILE) or {}


def _updated_at(folder: Path, state: dict) -> float | None:
    times = [t for t in (_float(state.get("updated_at")),) if t]
    for name in (runlog.METRICS_FILE, runlog.STATE_FILE):
        path = folder / name
        if path.is_file():
            times.append(path.stat().st_mtime)
    return max(times) if times else None


def _config_max_steps(folder: Path) -> int | None:
    try:
        raw = toml_io.loads((folder / runlog.CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, toml_io.TOMLDecodeError):
        return None
    training = raw.get("training")
    value = training.get("max_steps") if isinstance(training, dict) else None
    return value if _is_int(value) and value > 0 else None


def _last(rows: list[dict], key: str, kind: type = float) -> Any:
    for row in reversed(rows):
        value = row.get(key)
        if kind is float and _is_num(value) and math.isfinite(value):
            return float(value)
        if kind is str and isinstance(value, str):
            return value
    return None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(v: Any, default: int) -> int:
    return v if _is_int(v) else default


def _float(v: Any) -> float | None:
    return float(v) if _is_num(v) else None


def _text(v: Any) -> str | None:
    """A status word from a file: only strings count (a list there is not a status)."""
    return v if isinstance(v, str) else None


# ---------------------------------------------------------------------------- campaigns


def _campaign_or_why(folder: Path, now: float, run_dirs: list[Path]) -> CampaignStatus:
    """scan_campaign; one whose files break it still lists its runs, with the reason."""
    try:
        return scan_campaign(folder, now, run_dirs)
    except Exception as exc:  # noqa: BLE001 (whatever it is, the other campaigns still show)
        runs = [_run_or_why(d, folder, now) for d in run_dirs if folder in d.parents]
        return CampaignStatus(name=folder.name, path=str(folder), state="unknown",
                              conditions=[], seeds=[], runs=runs, counts=count_states(runs),
                              steps_left=0, time_left_s=None, api_slots_in_use=None,
                              max_concurrent=None,
                              problem=f"cannot be summarised ({type(exc).__name__}: {exc})"[:300])


def scan_campaign(folder: Path, now: float | None = None,
                  run_dirs: list[Path] | None = None) -> CampaignStatus:
    """Summarise a campaign from its manifest.json and its runs' folders. Run folders the
    manifest does not list (all of them, when it is torn) are shown too, never hidden."""
    now = time.time() if now is None else now
    manifest, problem = _read_manifest(folder)
    runs_value = manifest.get("runs")
    entries = [e for e in runs_value if isinstance(e, dict)] if isinstance(runs_value, list) \
        else []
    runs = [_campaign_run(folder, e, now) for e in entries]
    listed = {Path(r.path) for r in runs}
    if run_dirs is None:
        run_dirs, _ = runlog.walk_logs(folder)
    runs += [_run_or_why(d, folder, now) for d in run_dirs
             if folder in d.parents and d not in listed]
    parallel = bool(manifest.get("parallel"))
    max_workers = _int(manifest.get("max_workers"), 0)
    steps_left, time_left = _time_left(runs, parallel, max_workers)
    return CampaignStatus(
        name=str(manifest.get("campaign") or folder.name), path=str(folder),
        state=_campaign_state(manifest), problem=problem,
        conditions=_names(manifest.get("conditions"), [r.condition for r in runs]),
        seeds=_names(manifest.get("seeds"), [r.seed for r in runs]),
        runs=runs, counts=count_states(runs), steps_left=steps_left, time_left_s=time_left,
        api_slots_in_use=_slots_in_use(folder, manifest),
        max_concurrent=max(_int(manifest.get("max_concurrent"), 0), 0) or None,
        parallel=parallel, max_workers=max_workers, **_api_cap(folder),
        race=manifest["race"] if isinstance(manifest.get("race"), dict) else {},
        bill=total(r.bill for r in runs))


def _read_manifest(folder: Path) -> tuple[dict, str]:
    """(manifest, "") or ({}, why it cannot be read)."""
    try:
        return safejson.read_object(folder / runlog.MANIFEST_FILE), ""
    except OSError as exc:
        return {}, f"manifest.json cannot be read ({exc.strerror or exc})"
    except ValueError as exc:
        return {}, f"manifest.json is unusable ({exc})"


def _names(declared: Any, seen: list) -> list:
    """Condition names or seeds: scalars only (a hand-edited list may hold anything)."""
    ok = (str, int)
    out = [d for d in declared if isinstance(d, ok) and not isinstance(d, bool)] \
        if isinstance(declared, list) else []
    return out + [s for s in dict.fromkeys(seen) if s is not None and s not in out]


def _campaign_run(campaign: Path, entry: dict, now: float) -> RunStatus:
    name = str(entry.get("name") or "?")
    folder = _inside(campaign, entry.get("log_dir"), name)
    has_files = runlog.is_run_dir(folder)
    run = _run_or_why(folder, None, now) if has_files else \
        RunStatus(name=name, path=str(folder), state="pending")
    run.name = name
    run.condition = str(entry["condition"]) if entry.get("condition") is not None else None
    run.seed = _int(entry.get("seed"), 0) if _is_int(entry.get("seed")) else None
    run.attempts = _int(entry.get("attempts"), 0)
    run.exit_code = entry["exit_code"] if _is_int(entry.get("exit_code")) else None
    run.step = max(run.step, max(_int(entry.get("last_step"), 0), 0))
    run.max_steps = max(_int(entry.get("max_steps"), 0), 0) or run.max_steps
    if entry.get("node"):
        run.node = f"{_text(entry.get('host')) or '?'} ({str(entry['node'])[:8]})"
    status = _text(entry.get("status"))
    if status in ("completed", "failed") or (status == "skipped" and not has_files):
        run.state = status  # skipped: a run a race did not need
    elif status == "running" and not has_files:
        pid = _int(entry.get("pid"), 0)
        run.state = "running" if pid and runlog.pid_alive(pid) else "stale"
    elif not has_files and status in _FILE_STATES:
        run.state = status
    elif status == "interrupted" and run.state in ("stale", "pending"):
        run.state = "interrupted"
    return run


def _inside(campaign: Path, log_dir: Any, name: str) -> Path:
    """The run folder an entry names, kept inside the campaign folder (an absolute or `..`
    path in a hand-edited manifest falls back to the run's name)."""
    for candidate in (log_dir, name):
        if isinstance(candidate, str) and candidate and not Path(candidate).is_absolute() \
                and ".." not in Path(candidate).parts:
            return campaign / candidate
    return campaign / "?"


def _campaign_state(manifest: dict) -> str:
    status = manifest.get("status")
    if status == "running":
        runner = manifest.get("runner") if isinstance(manifest.get("runner"), dict) else {}
        pid, host = _int(runner.get("pid"), 0), str(runner.get("host") or "")
        if pid and (not host or host == socket.gethostname()) and not runlog.pid_alive(pid):
            return "stale"
    return status if isinstance(status, str) and status in _FILE_STATES else "unknown"


def _time_left(runs: list[RunStatus], parallel: bool, max_workers: int
               ) -> tuple[int, float | None]:
    """Steps left in unfinished runs, and the capacity formula's time for them."""
    open_runs = [r for r in runs if r.state in ("running", "pending", "stale", "interrupted")]
    left = sum(max(0, (r.max_steps or 0) - r.step) for r in open_runs)
    median = capacity.median_step_time(r.median_step_time_s for r in runs)
    if left == 0:
        return 0, 0.0
    if median is None:
        return left, None
    par = capacity.effective_parallelism(parallel, max_workers, len(open_runs))
    return left, capacity.wall_time_s(median, left, par)


def _api_cap(folder: Path) -> dict[str, Any]:
    """The auto concurrency controller's current cap and why (nothing for a fixed cap)."""
    from retrain.campaign.concurrency import last_decision

    row = last_decision(folder)
    if row is None:
        return {}
    return {"api_cap": row["cap"], "api_cap_reason": str(row.get("reason", ""))[:200]}


def _slots_in_use(folder: Path, manifest: dict) -> int | None:
    actor = manifest.get("slots_actor")
    if isinstance(actor, str) and actor:
        return _ray_slots_in_use(actor, manifest, folder)
    slots = manifest.get("slots_dir")
    if not isinstance(slots, str) or not slots or Path(slots).is_absolute() \
            or ".." in Path(slots).parts:
        return None
    try:
        from retrain.slots.file_slots import slots_in_use
    except ImportError:
        return None
    try:
        return int(slots_in_use(folder / slots))
    except (OSError, ValueError):
        return None


def _ray_slots_in_use(actor: str, manifest: dict, folder: Path) -> int | None:
    """Ask a running Ray campaign's slot actor (Ray is imported only for such a campaign), on
    its configured cluster, else on the one it started for itself."""
    if manifest.get("status") != "running":
        return None
    try:
        import ray

        from retrain.campaign.ray_cluster import recorded
        from retrain.slots.ray_slots import connect, find_broker

        own = None if manifest.get("ray_address") else recorded(folder)
        if own is not None:
            own.use_auth_mode()
        connect(own.address if own else str(manifest.get("ray_address") or ""))
        broker = find_broker(actor)
        return None if broker is None else int(ray.get(broker.stats.remote(), timeout=5)["in_use"])
    except Exception:  # no Ray, no cluster, actor gone: slots are unknown, status goes on
        return None

"""`retrain status [LOGDIR]`: scan a logs folder and summarise its runs and campaigns.

Read-only and tolerant: torn metrics lines are skipped (and counted), unreadable files show
as unknown values, and nothing here can change a run's files.
"""

from __future__ import annotations

import math
import shlex
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from retrain import capacity, render, runlog, safejson, toml_io
from retrain.errors import UserError

# A run that says "running" but whose process cannot be checked (another host) is stale
# after this long without an update, or after 5 median steps, whichever is longer.
STALE_AFTER_S = 600.0
STATES = ("running", "done", "failed", "stale", "pending", "interrupted")
_FROM_FILE = {"completed": "done", "running": "running", "failed": "failed",
              "pending": "pending", "interrupted": "interrupted"}


@dataclass
class RunStatus:
    name: str
    path: str
    state: str
    step: int = 0
    max_steps: int | None = None
    mean_reward: float | None = None
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
    parallel: bool = False
    max_workers: int = 0
    problem: str = ""              # why manifest.json could not be read (its runs still show)


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
    report.campaigns = [scan_campaign(c, now, run_dirs) for c in campaign_dirs]
    inside = [Path(c.path) for c in report.campaigns]
    report.runs = [scan_run(r, root, now) for r in run_dirs
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


def scan_run(folder: Path, root: Path | None = None, now: float | None = None) -> RunStatus:
    """Summarise one run folder from its state.json, metrics.jsonl and config.toml."""
    now = time.time() if now is None else now
    name = str(folder.relative_to(root)) if root and folder != root else folder.name
    state = _load_state(folder)
    metrics = runlog.read_metrics(folder / runlog.METRICS_FILE)
    rows = metrics.rows
    run = RunStatus(name=name, path=str(folder), state="pending", bad_lines=metrics.bad_lines)
    run.median_step_time_s = capacity.median_step_time(r.get("step_time_s") for r in rows)
    steps = [r["step"] for r in rows if _is_int(r.get("step"))]
    run.step = max([*steps, _int(state.get("step"), 0), 0])
    run.max_steps = max(_int(state.get("max_steps"), 0), 0) or _config_max_steps(folder)
    run.mean_reward = _last(rows, "mean_reward")
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
    run.updated_at = _updated_at(folder, state)
    run.state = _run_state(run, state, now)
    return run


def _run_state(run: RunStatus, state: dict, now: float) -> str:
    status = _text(state.get("status"))
    if status in _FROM_FILE and status != "running":
        return _FROM_FILE[status]
    if not state and run.max_steps and run.step >= run.max_steps:
        return "done"  # metrics only, and they reached the end
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
    runs += [scan_run(d, folder, now) for d in run_dirs
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
        parallel=parallel, max_workers=max_workers)


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
    run = scan_run(folder, None, now) if has_files else RunStatus(name=name, path=str(folder),
                                                                   state="pending")
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
    if status in ("completed", "failed"):
        run.state = _FROM_FILE[status]
    elif status == "running" and not has_files:
        pid = _int(entry.get("pid"), 0)
        run.state = "running" if pid and runlog.pid_alive(pid) else "stale"
    elif not has_files and status in _FROM_FILE:
        run.state = _FROM_FILE[status]
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
    return _FROM_FILE.get(status, "unknown") if isinstance(status, str) else "unknown"


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


def _slots_in_use(folder: Path, manifest: dict) -> int | None:
    actor = manifest.get("slots_actor")
    if isinstance(actor, str) and actor:
        return _ray_slots_in_use(actor, manifest)
    slots = manifest.get("slots_dir")
    if not isinstance(slots, str) or not slots or Path(slots).is_absolute() \
            or ".." in Path(slots).parts:
        return None
    try:
        from retrain.slots import slots_in_use
    except ImportError:
        return None
    try:
        return int(slots_in_use(folder / slots))
    except (OSError, ValueError):
        return None


def _ray_slots_in_use(actor: str, manifest: dict) -> int | None:
    """Ask a running Ray campaign's slot actor (Ray is imported only for such a campaign)."""
    if manifest.get("status") != "running":
        return None
    try:
        import ray

        from retrain.slots_ray import connect, find_broker

        connect(str(manifest.get("ray_address") or ""), start=False)
        broker = find_broker(actor)
        return None if broker is None else int(ray.get(broker.stats.remote(), timeout=5)["in_use"])
    except Exception:  # no Ray, no cluster, actor gone: slots are unknown, status goes on
        return None


# ---------------------------------------------------------------------------- rendering


def show(logdir: str | Path, as_json: bool = False, watch: bool = False,
         interval: float = 2.0) -> None:
    """Print the status once, or redraw it every `interval` seconds until Ctrl-C."""
    if watch and as_json:
        raise UserError("--watch and --json do not mix; poll `retrain status --json` instead")
    if watch:
        watch_status(logdir, interval)
        return
    report = scan(logdir)
    if as_json:
        print(render.dump_json(asdict(report)))
    elif render.stdout_is_terminal():
        from rich.console import Console

        Console().print(rich_view(report))
    else:
        print("\n".join(plain_lines(report)))


def watch_status(logdir: str | Path, interval: float = 2.0, iterations: int | None = None,
                 console: Any = None) -> None:
    """Redraw the status until Ctrl-C (or `iterations` redraws, for tests): live with rich on
    a terminal, a fresh plain report every `interval` seconds when piped."""
    from rich.console import Console

    console = console or Console()
    try:
        if console.is_terminal:
            _watch_live(logdir, interval, iterations, console)
        else:
            done = 0
            while True:
                print("\n".join(plain_lines(scan(logdir))) + "\n", flush=True)
                if iterations is not None and done >= iterations:
                    break
                time.sleep(interval)
                done += 1
    except KeyboardInterrupt:
        pass


def _watch_live(logdir: str | Path, interval: float, iterations: int | None,
                console: Any) -> None:
    from rich.live import Live

    done = 0
    with Live(rich_view(scan(logdir)), console=console, auto_refresh=False) as live:
        while iterations is None or done < iterations:
            time.sleep(interval)
            live.update(rich_view(scan(logdir)), refresh=True)
            done += 1


def header(report: StatusReport) -> str:
    """One line whose counts are exactly the rows listed below it."""
    parts = [_plural(len(report.runs), "run") + _counts_suffix(report.counts)]
    if report.campaigns:
        parts.append(_plural(len(report.campaigns), "campaign"))
    return f"{report.logdir}: " + ", ".join(parts)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _counts_suffix(counts: dict[str, int]) -> str:
    return " (" + ", ".join(f"{n} {s}" for s, n in counts.items()) + ")" if counts else ""


RUN_HEADERS = ["run", "state", "step", "reward", "step time", "tok/s", "max-tok hit",
               "bp", "bad lines"]


def _run_cells(r: RunStatus) -> list[str]:
    bp = "/".join(x for x in (r.bp_action, r.bp_regime) if x) or "-"
    if r.bp_p_star is not None:
        bp += f" p*={render.fmt_num(r.bp_p_star)}"
    if r.bp_throughput is not None:
        bp += f" {render.fmt_num(r.bp_throughput)} tok/s"
    return [r.name, r.state, f"{r.step}/{r.max_steps if r.max_steps else '?'}",
            render.fmt_num(r.mean_reward), render.fmt_seconds(r.median_step_time_s),
            render.fmt_num(r.tokens_per_second), render.fmt_num(r.max_token_hit_rate),
            bp, str(r.bad_lines)]


def runs_table(runs: list[RunStatus], with_campaign: bool = False) -> render.Table:
    headers = list(RUN_HEADERS)
    with_node = with_campaign and any(r.node for r in runs)
    if with_campaign:
        headers += ["attempts", "exit"] + (["node"] if with_node else [])
    rows = []
    for r in runs:
        cells = _run_cells(r)
        if with_campaign:
            cells += [str(r.attempts or 0), "-" if r.exit_code is None else str(r.exit_code)]
        if with_node:
            cells.append(r.node if r.node and r.state == "running" else "-")
        rows.append(cells)
    return render.Table(headers, rows)


def matrix_table(c: CampaignStatus) -> render.Table | None:
    """Conditions down, seeds across; each cell 'state step/max' (+ attempts when > 1).
    None when runs do not map one-to-one onto (condition, seed) cells (e.g. a grid)."""
    cells: dict[tuple, str] = {}
    for r in c.runs:
        text = f"{r.state} {r.step}/{r.max_steps or '?'}"
        if r.attempts and r.attempts > 1:
            text += f" (x{r.attempts})"
        cells[(r.condition, r.seed)] = text
    if not c.seeds or len(cells) < len(c.runs):
        return None
    conditions = c.conditions or [None]
    rows = [[str(cond) if cond else "-",
             *[cells.get((cond, s), "") for s in c.seeds]] for cond in conditions]
    return render.Table(["condition", *[f"seed {s}" for s in c.seeds]], rows)


def campaign_header(c: CampaignStatus) -> str:
    bits = [f"campaign '{c.name}' ({c.path}): {c.state}"
            + (f" ({c.problem}; its run folders are listed from disk)" if c.problem else ""),
            _plural(len(c.runs), "run") + _counts_suffix(c.counts)]
    if c.steps_left == 0:
        bits.append("no steps left")
    elif c.time_left_s is None:
        bits.append(f"{c.steps_left} steps left, time left unknown")
    else:
        bits.append(f"{c.steps_left} steps left, ~{capacity.human_duration(c.time_left_s)}")
    if c.api_slots_in_use is not None:
        bits.append(f"API slots {c.api_slots_in_use}/{c.max_concurrent or '?'} in use")
    return "; ".join(bits)


def _errors(runs: list[RunStatus]) -> list[str]:
    """One line per failed run: its recorded error, else its exit code."""
    out = []
    for r in runs:
        if r.state != "failed":
            continue
        why = r.error.strip().splitlines()[0] if r.error.strip() else (
            f"exit code {r.exit_code}" if r.exit_code is not None else "no error recorded")
        out.append(f"{r.name}: {why} ({r.path})")
    return out


def plot_hint(runs: list[RunStatus]) -> str | None:
    """Where to look at the back-pressure curve: the latest run that has one."""
    with_bp = [r for r in runs if r.bp_action]
    if not with_bp:
        return None
    r = max(with_bp, key=lambda r: r.updated_at or 0.0)
    hint = f"back-pressure picture: retrain plot {shlex.quote(r.path)}"
    if r.plot:
        hint += f" (last drawn: {r.plot})"
    if len(with_bp) > 1:
        hint += f"; {len(with_bp)} runs have one"
    return hint


def plain_lines(report: StatusReport) -> list[str]:
    """The report as plain text (what a pipe or a log file gets)."""
    if report.message:
        return [report.message]
    lines = [header(report)]
    if report.runs:
        lines += ["", *render.plain_table(runs_table(report.runs))]
        lines += [f"  failed: {e}" for e in _errors(report.runs)]
    for c in report.campaigns:
        lines += ["", campaign_header(c)]
        matrix = matrix_table(c)
        if matrix:
            lines += ["", *render.plain_table(matrix, indent="  ")]
        if c.runs:
            lines += ["", *render.plain_table(runs_table(c.runs, True), indent="  ")]
            lines += [f"  failed: {e}" for e in _errors(c.runs)]
    if any(r.bad_lines for r in _all_runs(report)):
        lines += ["", "bad lines = torn or garbage lines in metrics.jsonl, skipped"]
    hint = plot_hint(_all_runs(report))
    if hint:
        lines += ["", hint]
    return lines


def _all_runs(report: StatusReport) -> list[RunStatus]:
    return report.runs + [r for c in report.campaigns for r in c.runs]


def rich_view(report: StatusReport) -> Any:
    """The report as one rich renderable."""
    from rich.console import Group
    from rich.text import Text

    if report.message:
        return Text(report.message)
    parts: list[Any] = [Text(header(report), style="bold")]
    if report.runs:
        parts.append(render.rich_table(runs_table(report.runs)))
        parts += [Text(f"failed: {e}", style="red") for e in _errors(report.runs)]
    for c in report.campaigns:
        parts.append(Text("\n" + campaign_header(c), style="bold"))
        matrix = matrix_table(c)
        if matrix:
            parts.append(render.rich_table(matrix))
        if c.runs:
            parts.append(render.rich_table(runs_table(c.runs, True)))
            parts += [Text(f"failed: {e}", style="red") for e in _errors(c.runs)]
    hint = plot_hint(_all_runs(report))
    if hint:
        parts.append(Text("\n" + hint))
    parts.append(Text(time.strftime("updated %H:%M:%S"), style="dim"))
    return Group(*parts)

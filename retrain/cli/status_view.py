"""How `retrain status` shows a StatusReport: one list of blocks, rendered as plain text (a pipe,
a log file) or with rich (a terminal), so both always say the same things."""

from __future__ import annotations

import shlex
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from retrain.cli import render
from retrain.cli.render import Block
from retrain.cli.status import CampaignStatus, RunStatus, StatusReport, scan
from retrain.control import capacity
from retrain.errors import UserError
from retrain.results import compare, compare_view
from retrain.results.race_view import race_lines
from retrain.runfiles.runlog import MANIFEST_FILE


def blocks(report: StatusReport) -> list[Block]:
    """Everything the report shows, in order."""
    if report.message:
        return [Block(report.message)]
    out = [Block(header(report), style="bold")]
    if report.runs:
        out += [Block(table=runs_table(report.runs), gap=True), *_failures(report.runs)]
    for c in report.campaigns:
        out.append(Block(campaign_header(c), style="bold", gap=True))
        matrix = matrix_table(c)
        if matrix:
            out.append(Block(table=matrix, indent="  ", gap=True))
        if c.runs:
            out += [Block(table=runs_table(c.runs, True), indent="  ", gap=True),
                    *_failures(c.runs)]
        out += [Block(line, indent="  ", gap=i == 0) for i, line in enumerate(
            race_lines(c.race, str(Path(c.path) / MANIFEST_FILE)))]
        if compare.has_seeds_to_compare(c.runs):
            out += compare_view.status_blocks(c.path)
    runs = _all_runs(report)
    if any(r.bad_lines for r in runs):
        out.append(Block("bad lines = torn or garbage lines in metrics.jsonl, skipped", gap=True))
    hint = plot_hint(runs)
    if hint:
        out.append(Block(hint, gap=True))
    return out


def plain_lines(report: StatusReport) -> list[str]:
    """The report as plain text."""
    return render.plain_blocks(blocks(report))


def rich_view(report: StatusReport) -> Any:
    """The report as one rich renderable, with the time it was drawn."""
    from rich.console import Group
    from rich.text import Text

    parts: list[Any] = render.rich_blocks(blocks(report))
    if not report.message:
        parts.append(Text(time.strftime("updated %H:%M:%S"), style="dim"))
    return Group(*parts)


# ---------------------------------------------------------------------------- the pieces


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
               "bp", "spent", "bad lines"]


def _run_cells(r: RunStatus) -> list[str]:
    bp = "/".join(x for x in (r.bp_action, r.bp_regime) if x) or "-"
    if r.bp_p_star is not None:
        bp += f" p*={render.fmt_num(r.bp_p_star)}"
    if r.bp_throughput is not None:
        bp += f" {render.fmt_num(r.bp_throughput)} tok/s"
    return [r.name, r.state, f"{r.step}/{r.max_steps if r.max_steps else '?'}",
            render.fmt_num(r.mean_reward) + (f" ({render.fmt_num(r.mean_turns)} turns)"
                                             if r.mean_turns is not None else ""),
            render.fmt_seconds(r.median_step_time_s),
            render.fmt_num(r.tokens_per_second), render.fmt_num(r.max_token_hit_rate),
            bp, r.bill.text(), str(r.bad_lines)]


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
    if c.bill.text() != "-":
        bits.append(f"spent {c.bill.text()}")
    if c.api_cap is not None:
        used = "" if c.api_slots_in_use is None else f"{c.api_slots_in_use} in use, "
        bits.append(f"API cap {c.api_cap} (auto; {used}last: {c.api_cap_reason})")
    elif c.api_slots_in_use is not None:
        bits.append(f"API slots {c.api_slots_in_use}/{c.max_concurrent or '?'} in use")
    return "; ".join(bits)


def _failures(runs: list[RunStatus]) -> list[Block]:
    """One line per failed or unreadable run: its recorded error, else its exit code."""
    out = []
    for r in runs:
        if r.state not in ("failed", "unreadable"):
            continue
        why = r.error.strip().splitlines()[0] if r.error.strip() else (
            f"exit code {r.exit_code}" if r.exit_code is not None else "no error recorded")
        out.append(Block(f"{r.state}: {r.name}: {why} ({r.path})", style="red", indent="  "))
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


def _all_runs(report: StatusReport) -> list[RunStatus]:
    return report.runs + [r for c in report.campaigns for r in c.runs]


# ---------------------------------------------------------------------------- printing


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
        print(render.dump_json(as_json_dict(report)))
    elif render.stdout_is_terminal():
        from rich.console import Console

        Console().print(rich_view(report))
    else:
        print("\n".join(plain_lines(report)))


def as_json_dict(report: StatusReport) -> dict:
    """The report for --json: each campaign with >= 2 seeds in a condition carries its
    `comparison` (the `retrain compare --json` report)."""
    data = asdict(report)
    for c, out in zip(report.campaigns, data["campaigns"], strict=True):
        if compare.has_seeds_to_compare(c.runs):
            try:
                out["comparison"] = compare_view.to_json(compare.build(c.path))
            except Exception:  # noqa: BLE001 (a comparison that fails leaves the runs shown)
                out["comparison"] = None
    return data


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

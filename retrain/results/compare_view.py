"""How `retrain compare` shows a CompareReport: blocks rendered as plain text, with rich on a
terminal, or the report as JSON; all three say the same things."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from retrain.cli import render
from retrain.cli.render import Block
from retrain.errors import UserError
from retrain.results.compare import CompareReport, ConditionSummary, build
from retrain.results.race_view import race_lines
from retrain.results.stats import Estimate
from retrain.runfiles.runlog import MANIFEST_FILE, METRICS_FILE

HEADERS = ["condition", "rank", "seeds", "final reward", "eval accuracy", "best eval",
           "best eval step", "steps to thr", "seconds to thr", "cost to thr", "cost", "tok/s"]


def fmt_estimate(e: Estimate) -> str:
    """'0.512 [0.43, 0.594]'; one seed: '0.512 (n = 1, no interval)'; none: '-'."""
    if e.mean is None:
        return "-"
    if e.lo is None or e.hi is None:
        return f"{render.fmt_num(e.mean)} (n = 1, no interval)"
    return f"{render.fmt_num(e.mean)} [{render.fmt_num(e.lo)}, {render.fmt_num(e.hi)}]"


def _row(c: ConditionSummary) -> list[str]:
    reached = f" ({c.reached}/{c.completed} reached)" if c.completed else ""
    return [c.name, str(c.rank) if c.rank else "-", f"{c.completed}/{c.runs}",
            fmt_estimate(c.final_reward), fmt_estimate(c.eval_accuracy),
            fmt_estimate(c.best_eval), fmt_estimate(c.best_eval_step),
            fmt_estimate(c.steps_to_threshold) + reached, fmt_estimate(c.seconds_to_threshold),
            _cost(c.cost_to_threshold, c.tokens_to_threshold), _cost(c.cost_usd, c.tokens),
            fmt_estimate(c.tokens_per_second)]


def _cost(usd: Estimate, tokens: Estimate) -> str:
    """Dollars where the runs' [cost] prices them, else tokens (never a made-up price)."""
    if usd.mean is not None:
        return "$" + fmt_estimate(usd)
    return fmt_estimate(tokens) + (" tok" if tokens.mean is not None else "")


def table(report: CompareReport) -> render.Table:
    """The conditions' table; with the sampled eval's mean@k and pass@k where runs have them
    (training.eval_samples > 1) after eval accuracy."""
    rows = [_row(c) for c in report.conditions]
    if any(c.eval_mean_at_k.n for c in report.conditions):
        at = HEADERS.index("eval accuracy") + 1
        for c, row in zip(report.conditions, rows, strict=True):
            row[at:at] = [fmt_estimate(c.eval_mean_at_k), fmt_estimate(c.eval_pass_at_k)]
        return render.Table(HEADERS[:at] + ["eval mean@k", "eval pass@k"] + HEADERS[at:], rows)
    return render.Table(HEADERS, rows)


def header(report: CompareReport) -> str:
    counts: dict[str, int] = {}
    for r in report.runs:
        counts[r.state] = counts.get(r.state, 0) + 1
    states = ", ".join(f"{n} {s}" for s, n in counts.items())
    return (f"campaign '{report.campaign}' ({report.path}): {len(report.conditions)} "
            f"conditions, {len(report.runs)} runs ({states})")


def method_lines(report: CompareReport) -> list[str]:
    window = f"the last {report.last} steps" if report.last else "the last 10% of its steps"
    thr = "-" if report.threshold is None else render.fmt_num(report.threshold)
    return [f"final reward: a run's mean_reward averaged over {window}; eval accuracy: at its "
            "last eval; figures: mean over completed seeds [95% Student t interval]",
            f"threshold: {thr} ({report.threshold_source}); steps/seconds to reach it: first "
            "step whose trailing mean reward reaches it, seconds = summed step_time_s; cost: "
            "a run's bill in US dollars by its [cost] prices, else in tokens (docs/cost.md)"]


def verdict_lines(report: CompareReport) -> list[str]:
    out = []
    for c in report.conditions:
        for d in c.vs_baseline:
            out.append(f"{c.name} vs {report.baseline}: {d.verdict}")
    return out


def excluded_lines(report: CompareReport) -> list[str]:
    """A line per failed or running run; the runs not started yet in one line (a race leaves
    most of its grid pending: a line each buried the table)."""
    out = []
    pending = [r.name for r in report.excluded if r.state == "pending"]
    for r in report.excluded:
        if r.state == "pending":
            continue
        why = r.error.strip().splitlines()[0][:160] if r.error.strip() else ""
        out.append(f"excluded from the means: {r.name} ({r.state}{': ' + why if why else ''})")
    if pending:
        names = ", ".join(pending[:3]) + (", ..." if len(pending) > 3 else "")
        out.append(f"not started yet, so not in the means: {len(pending)} "
                   f"run{'s' if len(pending) > 1 else ''} ({names}; retrain status lists them)")
    skipped = [r.name for r in report.runs if r.state == "skipped"]
    if skipped:
        out.append(f"not run, the race did not need them: {', '.join(skipped)}")
    return out


def skipped_lines(report: CompareReport) -> list[str]:
    """Each run whose metrics file had rows dropped: the file, and what was dropped."""
    return [f"rows left out of {r.name}: {Path(r.path) / METRICS_FILE}: {r.skipped_note}"
            for r in report.runs if r.skipped_note]


def blocks(report: CompareReport) -> list[Block]:
    out = [Block(header(report), style="bold"),
           *[Block(line, style="dim") for line in method_lines(report)],
           Block(table=table(report), gap=True)]
    race = race_lines(report.race, str(Path(report.path) / MANIFEST_FILE))
    if race:
        out.append(Block("the race's decisions (manifest.json), each with the interval that "
                         "made it:", gap=True))
        out += [Block(line, indent="  ") for line in race]
    verdicts = verdict_lines(report)
    if verdicts:
        out.append(Block(f"against the baseline '{report.baseline}' (95% interval of the "
                         "difference: paired t over the seeds both have, else Welch):", gap=True))
        out += [Block(line, indent="  ") for line in verdicts]
    excluded = excluded_lines(report)
    out += [Block(line, style="yellow", gap=i == 0) for i, line in enumerate(excluded)]
    skipped = skipped_lines(report)
    out += [Block(line, style="yellow", gap=i == 0) for i, line in enumerate(skipped)]
    return out


def status_blocks(campaign_dir: str) -> list[Block]:
    """The short comparison `retrain status` shows under a campaign with >= 2 seeds in some
    condition (nothing when it cannot be built)."""
    try:
        report = build(campaign_dir)
    except UserError:
        return []
    except Exception as exc:  # noqa: BLE001 (status shows every run even when this fails)
        return [Block(f"no comparison: {type(exc).__name__}: {exc}"[:300], indent="  ",
                      gap=True)]
    rows = [[c.name, f"{c.completed}/{c.runs}", fmt_estimate(c.final_reward),
             fmt_estimate(c.eval_accuracy)] for c in report.conditions]
    t = render.Table(["condition", "seeds", "final reward", "eval accuracy"], rows)
    return [Block(table=t, indent="  ", gap=True),
            Block(f"compare with intervals and verdicts: retrain compare {report.path}",
                  indent="  ")]


def plain_lines(report: CompareReport) -> list[str]:
    return render.plain_blocks(blocks(report))


def to_json(report: CompareReport) -> dict[str, Any]:
    data = asdict(report)
    data["excluded"] = [r.name for r in report.excluded]
    return data


def show(campaign_dir: str | Path, *, as_json: bool = False, baseline: str | None = None,
         last: int | None = None, threshold: float | None = None) -> None:
    report = build(campaign_dir, baseline=baseline, last=last, threshold=threshold)
    if as_json:
        print(render.dump_json(to_json(report)))
    elif render.stdout_is_terminal():
        from rich.console import Console, Group

        Console().print(Group(*render.rich_blocks(blocks(report))))
    else:
        print("\n".join(plain_lines(report)))

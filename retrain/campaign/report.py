"""What a campaign says about its runs: how a worker exited, the tail of its log, and the
final table."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from retrain.campaign.manifest import WORKER_LOG, Manifest

TAIL_LINES = 15


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

"""`retrain compare logs/<campaign>`: each condition (grid cell) across its seeds, as means
with 95% intervals, and each condition against a baseline with a verdict: a paired t interval
over the seeds both have (runs of one seed share their luck), Welch where they share fewer than
two. A raced campaign also carries its race's decisions (manifest.json's `race`).

One report model (`CompareReport`), rendered plain, rich or as JSON by `compare_view`.
Only completed runs enter the means; failed, running and unfinished runs are listed apart.
Rows a run's metrics file cannot vouch for are dropped and named (`run_rows`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrain.cli.status import RunStatus, scan_campaign
from retrain.errors import UserError
from retrain.results.run_figures import SAMPLED, RunFigures, figures, reach
from retrain.results.run_rows import RunRows, read_run_rows
from retrain.results.stats import Difference, Estimate, difference, estimate, median
from retrain.runfiles import runlog

BILL = ("tokens", "cost_usd", "tokens_to_threshold", "cost_to_threshold")
COMPARED = (("final_reward", "final reward"), ("eval_accuracy", "eval accuracy"),
            ("eval_mean_at_k", "eval mean@k"), ("eval_pass_at_k", "eval pass@k"))


@dataclass
class ConditionSummary:
    """A condition (or grid cell) across its completed seeds."""

    name: str
    overrides: dict[str, Any]
    runs: int
    completed: int
    final_reward: Estimate
    eval_accuracy: Estimate
    eval_mean_at_k: Estimate                  # with training.eval_samples > 1 (else n = 0)
    eval_pass_at_k: Estimate
    best_eval: Estimate
    best_eval_step: Estimate
    steps_to_threshold: Estimate
    seconds_to_threshold: Estimate
    tokens_per_second: Estimate
    tokens: Estimate                          # the bill (docs/cost.md): per run, in all ...
    cost_usd: Estimate
    tokens_to_threshold: Estimate             # ... and up to the step that reached it
    cost_to_threshold: Estimate
    reached: int = 0                          # completed runs that reached the threshold
    rank: int | None = None                   # by final reward, 1 = highest
    vs_baseline: list[Difference] = field(default_factory=list)


@dataclass
class CompareReport:
    campaign: str
    path: str
    baseline: str
    threshold: float | None
    threshold_source: str                     # "--threshold" or how the default was found
    last: int | None                          # --last, or None for 10% of each run's steps
    conditions: list[ConditionSummary] = field(default_factory=list)
    runs: list[RunFigures] = field(default_factory=list)
    bad_lines: int = 0
    race: dict = field(default_factory=dict)  # manifest.json's race, for a raced campaign

    @property
    def excluded(self) -> list[RunFigures]:
        """Runs left out of the means (runs a race did not need were never run: not these)."""
        return [r for r in self.runs if not r.included and r.state != "skipped"]


def build(campaign_dir: str | Path, *, baseline: str | None = None, last: int | None = None,
          threshold: float | None = None) -> CompareReport:
    """The comparison of the campaign in `campaign_dir` (see the module docstring)."""
    folder = Path(campaign_dir)
    _check_folder(folder)
    if last is not None and last < 1:
        raise UserError(f"--last {last}: give a number of steps >= 1")
    if threshold is not None and not math.isfinite(threshold):
        raise UserError(f"--threshold {threshold}: give a finite reward")
    camp = scan_campaign(folder)
    names = [str(c) for c in camp.conditions] or sorted({r.condition or "-" for r in camp.runs})
    if not names:
        raise UserError(f"{folder}: the campaign has no runs yet (start it with "
                        "`retrain CAMPAIGN.toml`)")
    if baseline is not None and baseline not in names:
        raise UserError(f"--baseline {baseline!r} is not a condition of {folder}; its "
                        f"conditions are {', '.join(names)}")
    reads = {r.path: read_run_rows(Path(r.path)) for r in camp.runs}  # each file read once
    runs = [_figures(r, last, reads[r.path]) for r in camp.runs]
    report = CompareReport(campaign=camp.name, path=str(folder), baseline=baseline or names[0],
                           threshold=threshold, threshold_source="--threshold", last=last,
                           runs=runs, bad_lines=sum(r.bad_lines for r in runs))
    if threshold is None:
        finals = [r.final_reward for r in runs if r.included and r.final_reward is not None]
        report.threshold = median(finals) if finals else None
        report.threshold_source = "median final reward of all completed runs"
    rows_of = {r.path: reads[r.path].rows for r in runs if r.included}
    for r in runs:
        if r.included and report.threshold is not None:
            reach(r, rows_of[r.path], report.threshold, last)
    manifest = runlog.read_json(folder / runlog.MANIFEST_FILE) or {}
    report.race = manifest.get("race") if isinstance(manifest.get("race"), dict) else {}
    overrides = _overrides(manifest)
    report.conditions = [_summary(n, [r for r in runs if r.condition == n],
                                  overrides.get(n, {})) for n in names]
    _rank(report.conditions)
    base = next(c for c in report.conditions if c.name == report.baseline)
    base_runs = _included(runs, base.name)
    for c in report.conditions:
        if c is not base:
            mine = _included(runs, c.name)
            c.vs_baseline = [difference(label, _seeded(mine, key), _seeded(base_runs, key),
                                        c.name, base.name) for key, label in COMPARED
                             if key not in SAMPLED or _seeded(mine + base_runs, key)]
    return report


def _check_folder(folder: Path) -> None:
    if not folder.is_dir():
        raise UserError(f"{folder}: no such campaign folder (give logs/<campaign>)")
    if not runlog.is_campaign_dir(folder):
        _, campaigns = runlog.walk_logs(folder, max_depth=2)
        hint = f"; campaigns under it: {', '.join(str(c) for c in campaigns[:5])}" \
            if campaigns else ""
        raise UserError(f"{folder}: not a campaign folder (no {runlog.MANIFEST_FILE}); "
                        f"compare takes the folder a campaign writes, e.g. logs/<campaign>{hint}")


def _figures(status: RunStatus, last: int | None, read: RunRows) -> RunFigures:
    return figures(Path(status.path), last, read, name=status.name,
                   condition=status.condition or "-", seed=status.seed, state=status.state,
                   steps=status.step, error=status.error)


def _included(runs: list[RunFigures], condition: str) -> list[RunFigures]:
    return [r for r in runs if r.condition == condition and r.included]


def _values(runs: list[RunFigures], key: str) -> list[float]:
    return [v for r in runs if (v := getattr(r, key)) is not None]


def _seeded(runs: list[RunFigures], key: str) -> list[tuple[int | None, float]]:
    """(seed, value) of the runs that have the figure."""
    return [(r.seed, v) for r in runs if (v := getattr(r, key)) is not None]


def _summary(name: str, runs: list[RunFigures], overrides: dict) -> ConditionSummary:
    done = [r for r in runs if r.included]
    return ConditionSummary(
        name=name, overrides=overrides, runs=len(runs), completed=len(done),
        final_reward=estimate(_values(done, "final_reward")),
        eval_accuracy=estimate(_values(done, "eval_accuracy")),
        eval_mean_at_k=estimate(_values(done, "eval_mean_at_k")),
        eval_pass_at_k=estimate(_values(done, "eval_pass_at_k")),
        best_eval=estimate(_values(done, "best_eval")),
        best_eval_step=estimate([float(v) for v in _values(done, "best_eval_step")]),
        steps_to_threshold=estimate([float(v) for v in _values(done, "steps_to_threshold")]),
        seconds_to_threshold=estimate(_values(done, "seconds_to_threshold")),
        tokens_per_second=estimate(_values(done, "tokens_per_second")),
        **{k: estimate([float(v) for v in _values(done, k)]) for k in BILL},
        reached=sum(1 for r in done if r.steps_to_threshold is not None))


def _rank(conditions: list[ConditionSummary]) -> None:
    scored = sorted((c for c in conditions if c.final_reward.mean is not None),
                    key=lambda c: -c.final_reward.mean)
    for i, c in enumerate(scored, 1):
        c.rank = i


def _overrides(manifest: dict) -> dict[str, dict]:
    """Each condition label's overrides (its grid cell's values included), from the manifest."""
    entries = manifest.get("runs") if isinstance(manifest.get("runs"), list) else []
    out: dict[str, dict] = {}
    for e in entries:
        if isinstance(e, dict) and isinstance(e.get("condition"), str) \
                and isinstance(e.get("overrides"), dict):
            out.setdefault(e["condition"], e["overrides"])
    return out


def has_seeds_to_compare(runs: list[RunStatus]) -> bool:
    """Whether some condition has >= 2 seeds (then `status` shows the comparison)."""
    seen: dict[str | None, int] = {}
    for r in runs:
        seen[r.condition] = seen.get(r.condition, 0) + 1
    return any(n >= 2 for c, n in seen.items() if c is not None)

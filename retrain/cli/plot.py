"""`retrain plot RUN_DIR`: one PNG of a run's throughput curve, operating points, reward, step time.
(`retrain plot CAMPAIGN_DIR` draws the conditions' curves instead: retrain.results.campaign_plot.)

matplotlib is an optional extra (`pip install 'retrain[plot]'`), imported only here.
"""

from __future__ import annotations

import math
from pathlib import Path

from retrain.cli.figures import figure_class, save_png
from retrain.config import toml_io
from retrain.config.sections import BackpressureConfig
from retrain.control.usl import usl_throughput
from retrain.errors import UserError
from retrain.runfiles.runlog import (
    CONFIG_FILE,
    METRICS_FILE,
    PLOT_FILE,
    is_campaign_dir,
    read_metrics,
)

REGIME_COLORS = {"warmup": "#9e9e9e", "retrograde": "#d62728", "memory_bound": "#1f77b4",
                 "compute_bound": "#9467bd", "optimal": "#2ca02c"}


def plot(folder: Path, out: Path | None = None) -> Path:
    """A campaign folder: its conditions' curves (retrain.results.campaign_plot); a run
    folder: its back-pressure picture. Returns the PNG's path."""
    if is_campaign_dir(Path(folder)):
        from retrain.results.campaign_plot import plot_campaign

        return plot_campaign(Path(folder), out)
    return plot_run(folder, out)


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Draw RUN_DIR/metrics.jsonl into a PNG (default RUN_DIR/usl.png) and return its path."""
    run_dir = Path(run_dir)
    rows = _rows(run_dir)
    figure_cls = figure_class()
    out = Path(out) if out is not None else run_dir / PLOT_FILE
    fig = figure_cls(figsize=(13, 9), layout="constrained")
    ax = fig.subplots(2, 2)
    margin = _throttle_margin(run_dir)
    _curve(ax[0][0], rows, margin)
    _operating_points(ax[0][1], rows, margin)
    _series(ax[1][0], rows, [("mean_reward", "mean reward"), ("correct_rate", "correct rate")],
            "reward")
    _series(ax[1][1], rows, [("step_time_s", "step"), ("sample_time_s", "sample"),
                             ("train_time_s", "train")], "step time (s)")
    fig.suptitle(f"{run_dir.name}: {len(rows)} steps", fontsize=13)
    return save_png(fig, out, dpi=100)


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / METRICS_FILE
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run folder (give a folder like logs/<run>)")
    if not path.is_file():
        raise UserError(f"{path}: not found (has the run taken a step yet?)")
    rows = [r for r in read_metrics(path).rows if _num(r.get("step"))]
    if not rows:
        raise UserError(f"{path}: no metrics rows to plot (has the run taken a step yet?)")
    return sorted(rows, key=lambda r: r["step"])


def _throttle_margin(run_dir: Path) -> float:
    """[backpressure].throttle_margin from the run's config.toml, else the default."""
    default = BackpressureConfig().throttle_margin
    try:
        raw = toml_io.loads((run_dir / CONFIG_FILE).read_text(encoding="utf-8"))
        value = raw.get("backpressure", {}).get("throttle_margin", default)
    except (OSError, ValueError, AttributeError):
        return default
    return float(value) if _num(value) else default


def _num(v: object) -> bool:
    """A plottable number: finite and within what matplotlib can scale (|v| < 1e100)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
        and abs(v) < 1e100


def _concurrency(row: dict) -> float | None:
    if _num(row.get("bp_p")) and row["bp_p"] > 0:
        return row["bp_p"]
    b, g = row.get("batch_size"), row.get("group_size")
    return b * g if _num(b) and _num(g) else None


def _curve(ax, rows: list[dict], margin: float) -> None:
    """Observed throughput against p, the fitted USL curve, p* and the target."""
    in_work = any(_num(r.get("bp_step_throughput")) for r in rows)   # runs before: raw
    key = "bp_step_throughput" if in_work else "tokens_per_second"   # what the controller read
    pts = [(p, r[key], r["step"], r.get("bp_regime"))
           for r in rows if (p := _concurrency(r)) and _num(r.get(key))]
    ax.set_title("throughput vs concurrency p = batch_size x group_size")
    ax.set_xlabel("p (sequences in flight)")
    ax.set_ylabel("tokens/s")
    if not pts:
        ax.text(0.5, 0.5, "no throughput recorded", ha="center", transform=ax.transAxes)
        return
    ps, xs, steps, _ = zip(*pts, strict=True)
    sc = ax.scatter(ps, xs, c=steps, cmap="viridis", s=28, zorder=3, label="observed steps")
    ax.figure.colorbar(sc, ax=ax, label="step")
    fit = _last_fit(rows)
    hi = max(ps)
    if fit is None:
        ax.text(0.02, 0.95, "no USL fit in these metrics (back-pressure off or warming up)",
                transform=ax.transAxes, va="top", fontsize=9)
    else:
        sigma, kappa, lam, p_star = fit
        top = max(hi, p_star * 1.3 if p_star else hi) * 1.05
        grid = [1 + (top - 1) * i / 300 for i in range(301)]
        ax.plot(grid, [usl_throughput(p, sigma, kappa, lam) for p in grid], color="black",
                lw=1.5, label=f"USL fit: σ={sigma:.3g}, κ={kappa:.3g}, λ={lam:.3g}")
        if p_star:
            ax.axvline(p_star, color="#d62728", ls="--", lw=1.2, label=f"p* = {p_star:.0f}")
            ax.axvline(margin * p_star, color="#ff7f0e", ls=":", lw=1.5,
                       label=f"target {margin} x p* = {margin * p_star:.0f}")
        else:
            ax.text(0.02, 0.95, "p* unbounded (κ = 0): the target is max_batch_size",
                    transform=ax.transAxes, va="top", fontsize=9)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize=8)


def _last_fit(rows: list[dict]) -> tuple[float, float, float, float | None] | None:
    """(σ, κ, λ, p*) from the last row that carries a fit; p* None when unbounded."""
    for r in reversed(rows):
        sigma, kappa, lam = r.get("bp_sigma"), r.get("bp_kappa"), r.get("bp_lambda")
        # Only a fit the controller could have made (a hand-edited one may divide by 0).
        if _num(sigma) and _num(kappa) and _num(lam) and 0 <= sigma < 1 and kappa >= 0 \
                and lam > 0:
            p_star = r.get("bp_p_star")
            return sigma, kappa, lam, p_star if _num(p_star) and p_star > 0 else None
    return None


def _operating_points(ax, rows: list[dict], margin: float) -> None:
    """p of every step coloured by regime, with p* and the target as they were estimated."""
    ax.set_title("operating point over time")
    ax.set_xlabel("step")
    ax.set_ylabel("p")
    for regime, color in REGIME_COLORS.items():
        pts = [(r["step"], p) for r in rows
               if r.get("bp_regime") == regime and (p := _concurrency(r))]
        if pts:
            ax.scatter(*zip(*pts, strict=True), color=color, s=22, zorder=3, label=regime)
    plain = [(r["step"], p) for r in rows if not r.get("bp_regime") and (p := _concurrency(r))]
    if plain:
        ax.plot(*zip(*plain, strict=True), color="black", marker=".", lw=1, label="p")
    star = [(r["step"], r["bp_p_star"]) for r in rows if _num(r.get("bp_p_star"))]
    if star:
        steps, values = zip(*star, strict=True)
        ax.plot(steps, values, color="#d62728", ls="--", lw=1, label="p* (fit at that step)")
        ax.plot(steps, [margin * v for v in values], color="#ff7f0e", ls=":", lw=1.5,
                label=f"target {margin} x p*")
    ax.set_ylim(bottom=0)
    ax.legend(loc="best", fontsize=8)


def _series(ax, rows: list[dict], keys: list[tuple[str, str]], ylabel: str) -> None:
    ax.set_title(ylabel.split(" (")[0] + " per step")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    drawn = False
    for key, label in keys:
        pts = [(r["step"], r[key]) for r in rows if _num(r.get(key))]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="." if len(pts) < 60 else None, lw=1.2,
                    label=label)
            drawn = True
    if drawn:
        ax.legend(loc="best", fontsize=8)
    else:
        ax.text(0.5, 0.5, "not recorded", ha="center", transform=ax.transAxes)

"""A campaign's API concurrency picture (`max_concurrent = "auto"`): served throughput against
calls in flight with the fitted USL curve, p* and the chosen cap; and the cap over time.

Reads `<campaign>/concurrency.jsonl` (the controller's decisions). matplotlib is an optional
extra (`pip install 'retrain[plot]'`), imported only when drawing.
"""

from __future__ import annotations

import math
from pathlib import Path

from retrain.campaign.concurrency import LOG_FILE, read_decisions
from retrain.cli.figures import figure_class, save_png
from retrain.cli.plot import _num
from retrain.control.usl import usl_throughput
from retrain.errors import UserError

PLOT_FILE = "concurrency.png"
UNOBSERVED = "runs starting"   # rows the controller logged without observing them


def plot_concurrency(campaign_dir: str | Path, out_png: str | Path | None = None) -> Path:
    """Draw the campaign's concurrency decisions into a PNG (default
    `<campaign>/concurrency.png`) and return its path."""
    campaign_dir = Path(campaign_dir)
    rows = [r for r in read_decisions(campaign_dir) if _num(r.get("time"))]
    if not rows:
        raise UserError(f"{campaign_dir / LOG_FILE}: no concurrency decisions to plot (is "
                        "this a campaign with backend.max_concurrent = \"auto\" that has run "
                        "a few seconds?)")
    out = Path(out_png) if out_png is not None else campaign_dir / PLOT_FILE
    fig = figure_class()(figsize=(13, 5), layout="constrained")
    left, right = fig.subplots(1, 2)
    _curve(left, rows)
    _over_time(right, rows)
    fig.suptitle(f"{campaign_dir.name}: API calls in flight (max_concurrent = \"auto\")",
                 fontsize=13)
    return save_png(fig, out, dpi=100)


def _points(rows: list[dict]) -> list[tuple[float, float, int]]:
    """(calls in flight, throughput, errors) of the intervals the controller observed."""
    return [(r["in_flight"], r["throughput"], int(r.get("errors") or 0)) for r in rows
            if _num(r.get("in_flight")) and _num(r.get("throughput")) and r["in_flight"] > 0
            and r["throughput"] > 0 and not str(r.get("reason", "")).startswith(UNOBSERVED)]


def chosen_cap(rows: list[dict]) -> int:
    """The cap the campaign ran at most in its steady phase (its probes are brief), else the
    last one."""
    steady = [r["cap"] for r in rows if r.get("phase") == "steady"]
    return max(set(steady), key=steady.count) if steady else rows[-1]["cap"]


def fitted_lambda(points: list[tuple[float, float]], sigma: float, kappa: float) -> float:
    """λ of the USL with σ and κ fixed: least squares of X = λ g(p), g = p / (1 + σ(p−1) +
    κp(p−1)) (the log has σ, κ and p*; λ is the scale that fits the observations best)."""
    g = [(usl_throughput(p, sigma, kappa, 1.0), x) for p, x in points]
    den = sum(a * a for a, _ in g)
    return sum(a * x for a, x in g) / den if den > 0 else 0.0


def _last_fit(rows: list[dict]) -> tuple[float, float, float | None] | None:
    for r in reversed(rows):
        sigma, kappa = r.get("sigma"), r.get("kappa")
        if _num(sigma) and _num(kappa) and 0 <= sigma < 1 and kappa >= 0:
            p_star = r.get("p_star")
            return sigma, kappa, p_star if _num(p_star) and p_star > 0 else None
    return None


def _curve(ax, rows: list[dict]) -> None:
    ax.set_title("served throughput vs API calls in flight")
    ax.set_xlabel("calls in flight (mean over an interval)")
    ax.set_ylabel("calls served/s")
    pts = _points(rows)
    if not pts:
        ax.text(0.5, 0.5, "no traffic recorded", ha="center", transform=ax.transAxes)
        return
    ok = [(p, x) for p, x, e in pts if not e]
    bad = [(p, x) for p, x, e in pts if e]
    if ok:
        ax.scatter(*zip(*ok, strict=True), s=24, color="#1f77b4", zorder=3, label="interval")
    if bad:
        ax.scatter(*zip(*bad, strict=True), s=40, color="#d62728", marker="x", zorder=4,
                   label="interval with 429/5xx")
    cap = chosen_cap(rows)
    top = max(max(p for p, _, _ in pts), cap) * 1.2
    fit = _last_fit(rows)
    if fit is not None:
        sigma, kappa, p_star = fit
        lam = fitted_lambda(ok or [(p, x) for p, x, _ in pts], sigma, kappa)
        if p_star is not None:
            top = max(top, p_star * 1.3)
        grid = [1 + (top - 1) * i / 300 for i in range(301)]
        ax.plot(grid, [usl_throughput(p, sigma, kappa, lam) for p in grid], color="black",
                lw=1.5, label=f"USL fit: σ={sigma:.3g}, κ={kappa:.3g}")
        if p_star is not None and math.isfinite(p_star):
            ax.axvline(p_star, color="#d62728", ls="--", lw=1.2, label=f"p* = {p_star:.1f}")
    ax.axvline(cap, color="#2ca02c", lw=2, label=f"chosen cap = {cap}")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize=8)


def _over_time(ax, rows: list[dict]) -> None:
    t0 = rows[0]["time"]
    ts = [r["time"] - t0 for r in rows]
    ax.set_title("the cap over time")
    ax.set_xlabel("seconds")
    ax.set_ylabel("calls")
    ax.step(ts, [r["cap"] for r in rows], where="post", color="#2ca02c", label="cap")
    flight = [(t, r["in_flight"]) for t, r in zip(ts, rows, strict=True)
              if _num(r.get("in_flight"))]
    if flight:
        ax.plot(*zip(*flight, strict=True), color="#1f77b4", lw=1, label="calls in flight")
    errs = [(t, r["cap"]) for t, r in zip(ts, rows, strict=True) if r.get("errors")]
    if errs:
        ax.scatter(*zip(*errs, strict=True), color="#d62728", marker="x", zorder=4,
                   label="429/5xx: cut")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize=8)

"""`retrain plot logs/<campaign>`: reward and eval-accuracy curves per condition on one PNG.

Each condition is drawn as the mean over its seeds at every step with a 95% Student t band,
over its seeds' own curves drawn faint. Failed runs are left out (and the figure says so);
runs still going are drawn as far as they got. matplotlib is imported only here.
"""

from __future__ import annotations

from pathlib import Path

from retrain.cli.figures import figure_class, save_png
from retrain.cli.status import scan_campaign
from retrain.errors import UserError
from retrain.results.run_rows import number, read_rows
from retrain.results.stats import estimate

CAMPAIGN_PLOT_FILE = "curves.png"   # `retrain plot CAMPAIGN_DIR` draws here by default
FIGSIZE = (13, 5)                   # inches, at DPI: a 1300 x 500 PNG
DPI = 100
PLOT_LIMIT = 1e100                  # beyond this a value is not drawn (axis limits overflow)
PANELS = (("mean_reward", "mean reward per step"), ("eval_accuracy", "held-out eval accuracy"))


def plot_campaign(campaign_dir: Path, out: Path | None = None) -> Path:
    """Draw the campaign's curves into a PNG (default CAMPAIGN_DIR/curves.png); its path."""
    folder = Path(campaign_dir)
    camp = scan_campaign(folder)
    curves = {}  # condition -> [(run name, rows)]
    left_out = []
    for r in camp.runs:
        rows = read_rows(Path(r.path))
        if r.state == "failed" or not rows:
            left_out.append(f"{r.name} ({r.state if r.state == 'failed' else 'no steps yet'})")
            continue
        curves.setdefault(r.condition or "-", []).append((r.name, rows))
    if not curves:
        raise UserError(f"{folder}: no run of this campaign has metrics to plot yet")
    figure_cls = figure_class()
    fig = figure_cls(figsize=FIGSIZE, layout="constrained")
    axes = fig.subplots(1, len(PANELS))
    colors = [f"C{i % 10}" for i in range(len(curves))]
    for ax, (key, title) in zip(axes, PANELS, strict=True):
        _panel(ax, key, title, curves, colors)
    note = f"; left out: {', '.join(left_out)}" if left_out else ""
    fig.suptitle(f"campaign {camp.name}: mean over seeds with 95% band{note}", fontsize=12)
    out = Path(out) if out is not None else folder / CAMPAIGN_PLOT_FILE
    return save_png(fig, out, dpi=DPI)


def _panel(ax, key: str, title: str, curves: dict, colors: list[str]) -> None:
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    drawn = False
    for (condition, runs), color in zip(curves.items(), colors, strict=True):
        per_seed = [{r["step"]: x for r in rows if (x := _plottable(r.get(key))) is not None}
                    for _, rows in runs]
        per_seed = [s for s in per_seed if s]
        if not per_seed:
            continue
        for seed in per_seed:
            steps = sorted(seed)
            ax.plot(steps, [seed[s] for s in steps], color=color, alpha=0.25, lw=0.8)
        steps = sorted(set().union(*per_seed))
        band = [estimate([seed[s] for seed in per_seed if s in seed]) for s in steps]
        ax.plot(steps, [e.mean for e in band], color=color, lw=2,
                marker="o" if len(steps) <= 30 else None, ms=3,
                label=f"{condition} (n = {len(per_seed)})")
        ax.fill_between(steps, [e.lo if e.lo is not None else e.mean for e in band],
                        [e.hi if e.hi is not None else e.mean for e in band], color=color,
                        alpha=0.2, lw=0)
        drawn = True
    if drawn:
        ax.legend(loc="best", fontsize=8)
    else:
        ax.text(0.5, 0.5, "not recorded", ha="center", transform=ax.transAxes)


def _plottable(v: object) -> float | None:
    """A number matplotlib can scale (|v| < 1e100, as `retrain plot RUN_DIR` draws), else
    None: a reward near the float limit would make its axis limits overflow."""
    x = number(v)
    return x if x is not None and abs(x) < PLOT_LIMIT else None

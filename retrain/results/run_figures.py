"""One run's figures: the numbers `retrain compare` puts in its table, and the one a race
decides on (`race_value`), computed in one place so that both say the same.

final_reward: the run's mean_reward averaged over its last 10% of steps (at least 1; `last`
steps when given); eval_accuracy: at its last eval; best_eval: its highest eval (and the first
step that reached it); eval_mean_at_k / eval_pass_at_k: the sampled eval's mean@k and pass@k
at its last eval (training.eval_samples > 1); steps and seconds to a threshold: the first step
whose trailing mean reward (over the final-reward window) reaches it, and the summed step_time_s
up to it; the run's tokens and cost ([cost] of its config.toml, docs/cost.md), in all and up
to that step.
Reads the run folder only through `run_rows`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from retrain.bill.prices import price
from retrain.bill.tally import Tally
from retrain.results.run_rows import RunRows, number, read_run_rows, series
from retrain.results.spent import run_prices
from retrain.results.stats import mean, trailing_means

LAST_FRACTION = 0.1      # --last default: the last 10% of a run's steps (at least 1)
# The figures a race may decide on, by their names in `compare`.
METRICS = ("final_reward", "eval_accuracy", "eval_mean_at_k", "eval_pass_at_k", "best_eval",
           "steps_to_threshold", "seconds_to_threshold")
SAMPLED = ("eval_mean_at_k", "eval_pass_at_k")  # rows with training.eval_samples > 1
THRESHOLD_METRICS = ("steps_to_threshold", "seconds_to_threshold")


@dataclass
class RunFigures:
    """One run's figures (None where its metrics lack them), and what its metrics file lost."""

    name: str = ""
    path: str = ""
    condition: str = "-"
    seed: int | None = None
    state: str = ""
    steps: int = 0
    bad_lines: int = 0
    duplicate_rows: int = 0                  # rows of steps logged more than once, dropped
    non_finite_rows: int = 0                 # rows with a non-finite figure, dropped
    skipped_note: str = ""                   # the above in words, with the steps
    last_k: int = 0                          # steps averaged into final_reward
    final_reward: float | None = None
    eval_accuracy: float | None = None       # at the last eval
    eval_step: int | None = None
    eval_mean_at_k: float | None = None      # at the last sampled eval (eval_samples > 1)
    eval_pass_at_k: float | None = None
    best_eval: float | None = None
    best_eval_step: int | None = None
    steps_to_threshold: int | None = None    # None: never reached
    seconds_to_threshold: float | None = None
    tokens_per_second: float | None = None
    tokens: int | None = None                # prefill + sampled + trained (docs/cost.md)
    cost_usd: float | None = None            # None: its [cost] prices nothing
    tokens_to_threshold: int | None = None   # ... spent up to the step that reached it
    cost_to_threshold: float | None = None
    error: str = ""

    @property
    def included(self) -> bool:
        return self.state == "completed"


def window(n_steps: int, last: int | None) -> int:
    """How many of a run's last steps its final reward averages."""
    return max(1, last if last is not None else int(n_steps * LAST_FRACTION))


def figures(run_dir: Path, last: int | None = None, read: RunRows | None = None,
            **identity: object) -> RunFigures:
    """The figures of the run in `run_dir` (all but the threshold ones: see `reach`), from its
    rows `read` when the caller has them; `identity` fills name, condition, seed, state, ..."""
    read = read if read is not None else read_run_rows(run_dir)
    fig = RunFigures(path=str(run_dir), **identity)
    _dropped(fig, read)
    rows = read.rows
    rewards = [x for _, x in series(rows, "mean_reward")]
    if rewards:
        fig.last_k = min(window(len(rewards), last), len(rewards))
        fig.final_reward = mean(rewards[-fig.last_k:])
    evals = series(rows, "eval_accuracy")
    if evals:
        fig.eval_step, fig.eval_accuracy = evals[-1]
        fig.best_eval_step, fig.best_eval = max(evals, key=lambda e: (e[1], -e[0]))
    for key in SAMPLED:
        if sampled := series(rows, key):
            setattr(fig, key, sampled[-1][1])
    speeds = [x for _, x in series(rows, "tokens_per_second")]
    fig.tokens_per_second = mean(speeds) if speeds else None
    spent = Tally.of_rows(rows)
    if any(r.get("sampled_tokens") is not None for r in rows):  # rows that count tokens
        fig.tokens, fig.cost_usd = spent.tokens, price(spent, run_prices(run_dir)).usd
    return fig


def _dropped(fig: RunFigures, read: RunRows) -> None:
    fig.bad_lines, fig.duplicate_rows = read.bad_lines, read.duplicate_rows
    fig.non_finite_rows = len(read.non_finite_steps)
    fig.skipped_note = read.note()


def reach(fig: RunFigures, rows: list[dict], threshold: float, last: int | None) -> None:
    """The first step whose trailing mean reward (over the final-reward window) reaches the
    threshold, and the summed step_time_s up to it (both None when it never does)."""
    rewards = series(rows, "mean_reward")
    k = window(len(rewards), last)
    seconds, spent = {}, {}
    total, bill = 0.0, Tally()
    for r in rows:
        total += number(r.get("step_time_s")) or 0.0
        bill = bill + Tally.of_row(r)
        seconds[r["step"]], spent[r["step"]] = total, bill
    # (one pass: summing each window again grew with the square of the steps, 10% per window)
    means = trailing_means((x for _, x in rewards), k)
    for (step, _), trailing in zip(rewards, means, strict=True):
        if trailing >= threshold:
            fig.steps_to_threshold, fig.seconds_to_threshold = step, seconds[step]
            if fig.tokens is not None:  # the bill up to that step
                fig.tokens_to_threshold = spent[step].tokens
                fig.cost_to_threshold = price(spent[step], run_prices(Path(fig.path))).usd
            return


def race_value(run_dir: Path, metric: str, threshold: float | None = None) -> float | None:
    """The figure `metric` of a finished run, as a race reads it (None: the run has none).
    A run that never reached the threshold counts at its last step (steps_to_threshold) or its
    summed step_time_s (seconds_to_threshold): a censored value, the least it would take."""
    read = read_run_rows(run_dir)
    fig = figures(run_dir, read=read)
    if metric not in THRESHOLD_METRICS:
        value = getattr(fig, metric)
        return None if value is None else float(value)
    rows = read.rows
    if threshold is None or not series(rows, "mean_reward"):
        return None
    reach(fig, rows, threshold, None)
    if fig.steps_to_threshold is not None:
        return float(getattr(fig, metric))
    if metric == "steps_to_threshold":
        return float(rows[-1]["step"])
    return sum(number(r.get("step_time_s")) or 0.0 for r in rows)

"""[campaign.race]: race the campaign's conditions seed by seed instead of running every seed of
every condition (docs/campaigns.md, "Racing"). The table, checked key by key (bounds,
did-you-mean) and against the rest of the campaign; `race.py` makes the decisions.

Pure: no torch, no SDK, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from retrain.config.schema import ConfigIssue, opt, show, table_issues
from retrain.config.sections import Config

TABLE = "campaign.race"
# The figures a race may decide on, by their names in `retrain compare`.
METRICS = ("final_reward", "eval_accuracy", "eval_mean_at_k", "eval_pass_at_k", "best_eval",
           "steps_to_threshold", "seconds_to_threshold")
THRESHOLD_METRICS = ("steps_to_threshold", "seconds_to_threshold")
SAMPLED_METRICS = ("eval_mean_at_k", "eval_pass_at_k")  # need training.eval_samples > 1
EVAL_METRICS = ("eval_accuracy", *SAMPLED_METRICS, "best_eval")
# Which way each metric is better: fewer steps or seconds to a threshold, more of the rest.
NATURAL = {m: "min" if m in THRESHOLD_METRICS else "max" for m in METRICS}
MAX_SEEDS = 10_000


@dataclass
class RacePlan:
    """The [campaign.race] table."""

    metric: str = opt("final_reward", "the figure the race decides on, by its name in "
                      "`retrain compare`", choices=METRICS)
    direction: str = opt("max", "which way is better: max (a reward, an accuracy) or min "
                         "(steps or seconds to a threshold); the metric's own way when left "
                         "out, and no other", choices=("max", "min"))
    min_seeds: int = opt(3, "seeds every condition runs before the first decision", lo=2,
                         hi=MAX_SEEDS)
    max_seeds: int = opt(0, "the most seeds a condition runs, the first max_seeds of [campaign] "
                         "seeds (0 = all of them)", lo=0, hi=MAX_SEEDS)
    round_seeds: int = opt(1, "seeds added to every condition still racing after each "
                           "decision", lo=1, hi=MAX_SEEDS)
    confidence: float = opt(0.95, "the chance that every decision of the race is right (no "
                            "best condition eliminated, no false winner or equivalence)",
                            lo=0.5, hi=0.9999)
    margin: float = opt(0.0, "equivalence band: the race stops when every pair still racing "
                        "differs by less than this, beyond doubt (0 = never)", lo=0)
    budget_runs: int = opt(0, "the most runs the race may start in all (0 = conditions x "
                           "max_seeds)", lo=0, hi=100_000_000)
    interim_share: float = opt(0.2, "the share of 1 - confidence the decisions before the "
                               "last may spend, by the seeds they have seen (small: the last "
                               "decision keeps most and loses little power; 1: spent evenly, "
                               "early stops come sooner)", lo=0, hi=1, lo_open=True)
    threshold: float | str = opt("none", "the trailing mean reward steps_to_threshold and "
                                 "seconds_to_threshold count to", words=("none",))

    def seeds_cap(self, seeds: int) -> int:
        """max_seeds resolved against the campaign's number of seeds."""
        return self.max_seeds or seeds

    @property
    def threshold_value(self) -> float | None:
        return None if isinstance(self.threshold, str) else float(self.threshold)


def parse(value: Any, issues: list[ConfigIssue]) -> dict:
    """Check a [campaign.race] table key by key (coercing good values in place); the table
    to store on the plan ({} when it has a problem: the problems are in `issues`)."""
    if not isinstance(value, dict):
        issues.append(ConfigIssue(TABLE, f"must be a table ([{TABLE}]), got {show(value)}"))
        return {}
    found = table_issues(RacePlan, value, TABLE)
    if not found:
        found = _direction_issues(value)
    issues += found
    # The metric and direction are always written out, so that an empty [campaign.race] (every
    # default) is a race, and the plan's default {} is none.
    metric = value.get("metric", RacePlan.metric)
    return {} if found else {"metric": metric, "direction": NATURAL[metric], **value}


def _direction_issues(table: dict) -> list[ConfigIssue]:
    """A direction against its metric's (more steps to a threshold counted as better would
    crown the slowest condition)."""
    metric = table.get("metric", RacePlan.metric)
    given, natural = table.get("direction"), NATURAL[metric]
    if given is None or given == natural:
        return []
    better = "fewer is better" if natural == "min" else "more is better"
    return [ConfigIssue(f"{TABLE}.direction", f"is {show(given)} but metric = {show(metric)} "
                        f"is always raced {show(natural)} ({better}); remove direction or set "
                        f"direction = {show(natural)}")]


def race_of(table: dict) -> RacePlan | None:
    """The race a checked [campaign.race] table describes (None: the file has none)."""
    return RacePlan(**table) if table else None


def plan_issues(race: RacePlan, seeds: list[int], cells: int) -> list[ConfigIssue]:
    """Problems of a race with the campaign around it: `seeds` are [campaign] seeds, `cells`
    the conditions (grid cells) it races."""
    issues = []
    if cells < 2:
        issues.append(ConfigIssue(TABLE, "a race needs at least 2 conditions (or grid cells) "
                                  "to choose between; add [[campaign.conditions]]"))
    cap = race.seeds_cap(len(seeds))
    if len(seeds) < race.min_seeds:
        issues.append(ConfigIssue(f"{TABLE}.min_seeds", f"is {race.min_seeds} but [campaign] "
                                  f"seeds holds {len(seeds)}; list at least {race.min_seeds} "
                                  "seeds (a race takes them in order)"))
    elif race.max_seeds > len(seeds):
        issues.append(ConfigIssue(f"{TABLE}.max_seeds", f"is {race.max_seeds} but [campaign] "
                                  f"seeds holds {len(seeds)}; list more seeds or lower it"))
    elif cap < race.min_seeds:
        issues.append(ConfigIssue(f"{TABLE}.max_seeds", f"must be >= min_seeds "
                                  f"({race.min_seeds}), got {race.max_seeds}"))
    first = cells * race.min_seeds
    if race.budget_runs and cells >= 2 and race.budget_runs < first:
        issues.append(ConfigIssue(f"{TABLE}.budget_runs", f"is {race.budget_runs}, fewer than "
                                  f"the first round's {first} runs ({cells} conditions x "
                                  f"min_seeds {race.min_seeds})"))
    issues += _threshold_issues(race)
    return issues


def _threshold_issues(race: RacePlan) -> list[ConfigIssue]:
    where = f"{TABLE}.threshold"
    if race.metric in THRESHOLD_METRICS and race.threshold_value is None:
        return [ConfigIssue(where, f"metric = {show(race.metric)} counts steps to a reward "
                            "threshold: set threshold (e.g. threshold = 0.9)")]
    if race.metric not in THRESHOLD_METRICS and race.threshold_value is not None:
        return [ConfigIssue(where, "is only read by steps_to_threshold and "
                            f"seconds_to_threshold, not by metric = {show(race.metric)}")]
    return []


def run_issues(race: RacePlan, runs: dict[str, Config]) -> list[ConfigIssue]:
    """A race on a metric some condition's runs do not produce (`runs`: condition -> one of its
    run configs): an eval metric without a held-out split, a reward metric without RL steps."""
    issues = []
    for condition, cfg in runs.items():
        if race.metric in EVAL_METRICS and cfg.data.eval_size == 0:
            issues.append(ConfigIssue(f"{TABLE}.metric", f"{show(race.metric)} needs a held-out "
                                      f"eval, but condition '{condition}' has data.eval_size = "
                                      "0; set data.eval_size or race on final_reward"))
        elif race.metric in SAMPLED_METRICS and cfg.training.eval_samples < 2:
            issues.append(ConfigIssue(f"{TABLE}.metric", f"{show(race.metric)} is the sampled "
                                      f"eval's, but condition '{condition}' has "
                                      "training.eval_samples = 1; set training.eval_samples "
                                      "(e.g. 8) or race on eval_accuracy"))
        elif race.metric not in EVAL_METRICS and cfg.training.max_steps == 0:
            issues.append(ConfigIssue(f"{TABLE}.metric", f"{show(race.metric)} is read from the "
                                      f"RL steps' rewards, but condition '{condition}' has "
                                      "training.max_steps = 0 (an SFT-only run)"))
        if issues:
            break  # one line: the first condition that cannot be raced
    return issues


def resolution(race: RacePlan, runs: dict[str, Config]) -> float:
    """The step of the grid the race's figure lies on (`race.compare` floors the spread of
    differences at it): 1 / eval problems for an accuracy (the coarsest condition's), 1 /
    (problems x eval_samples) for mean@k, one step for steps_to_threshold, 0 (none known) for
    a mean reward or seconds."""
    if race.metric in EVAL_METRICS:
        per = (lambda cfg: cfg.training.eval_samples) if race.metric == "eval_mean_at_k" \
            else (lambda cfg: 1)
        sizes = [cfg.data.eval_size * per(cfg) for cfg in runs.values()
                 if cfg.data.eval_size > 0]
        return 1.0 / min(sizes) if sizes else 0.0
    return 1.0 if race.metric == "steps_to_threshold" else 0.0

"""A raced campaign's runs ([campaign.race], docs/campaigns.md "Racing"): which runs the race has
released, its next decision once every run of a round has finished, and its state in
manifest.json (`race`), written before the next round starts, so that a killed runner's
successor resumes the same race: the same decisions, no run twice.

The decisions are `race.py`'s; this module only reads each finished run's figure (through
`results/run_figures`, as `retrain compare` does) and keeps the manifest.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from retrain.campaign import race as race_mod
from retrain.campaign.manifest import Manifest, RunEntry
from retrain.campaign.matrix import RunSpec
from retrain.campaign.race import RaceState, new_race
from retrain.campaign.race_plan import RacePlan, race_of, run_issues
from retrain.campaign.race_record import RaceRecordError, read_state
from retrain.config.sections import Config, ConfigError
from retrain.errors import UserError
from retrain.results.run_figures import race_value


def check_runs(race: RacePlan, configs: dict[str, Config], source: str) -> None:
    """Refuse (one line) a race on a metric some condition's runs do not produce."""
    issues = run_issues(race, configs)
    if issues:
        raise ConfigError(source, issues)


def check_resume(old: Manifest | None, table: dict, force: bool, source: str,
                 specs: list[RunSpec]) -> None:
    """Refuse to go on with a race whose plan, conditions or seed order changed since its first
    decision (the decisions so far were made under the old ones) unless forced; forcing drops
    its decisions. `specs`: the campaign's runs now, in matrix order."""
    before = (old.race or {}) if old is not None else {}
    state = before.get("state") if isinstance(before.get("state"), dict) else {}
    if not state.get("looks"):
        return
    race = race_of(table) if table else None
    now = asdict(race) if race else None
    seeds = list(dict.fromkeys(s.seed for s in specs))
    drawn = (list(dict.fromkeys(s.condition for s in specs)), seeds[:race.seeds_cap(len(seeds))]
             ) if race else None
    if force or (before.get("plan") == now and drawn == (state.get("conditions"),
                                                         state.get("seeds"))):
        return
    made = f"since the race's first decision ({len(state['looks'])} made)"
    keep = ("Start a fresh campaign with --new, or --force to drop them (the runs so far are "
            "kept and read again)")
    if before.get("plan") != now:
        what = "was removed" if now is None else "changed"
        raise UserError(f"{source}: [campaign.race] {what} {made}; its decisions hold only for "
                        f"the plan they were made under. {keep}")
    changed = "; ".join(f"{w} {_shown(a)} -> {_shown(b)}" for w, a, b in zip(
        ("conditions", "seeds"), (state.get("conditions"), state.get("seeds")), drawn,
        strict=True) if a != b)
    raise UserError(f"{source}: the race's {changed} {made}; a race takes its seeds in order, "
                    "so its decisions hold only for the seeds and order they were made with. "
                    f"Restore [campaign] seeds (and conditions) as they were. {keep}")


def _shown(values: object) -> str:
    return ", ".join(map(str, values)) if isinstance(values, list) else repr(values)


def keeper_for(race: RacePlan | None, manifest: Manifest, run_dirs: dict[str, Path],
               max_retries: int, resolution: float = 0.0) -> RaceKeeper | None:
    """The campaign's race; without one (never had one, or it was dropped under --force), runs
    a race had skipped are pending again. `resolution`: the figure's grid step."""
    if race is not None:
        return RaceKeeper(race, manifest, run_dirs, max_retries, resolution)
    for e in manifest.runs:
        if e.status == "skipped":
            e.status = "pending"
    manifest.race = {}
    return None


class RaceKeeper:
    """The race of one campaign, resumed from its manifest (or started)."""

    def __init__(self, race: RacePlan, manifest: Manifest, run_dirs: dict[str, Path],
                 max_retries: int, resolution: float = 0.0):
        self.race, self.manifest, self.run_dirs = race, manifest, run_dirs
        self.max_retries = max_retries
        self.resolution = resolution  # the figure's grid step (race_plan.resolution)
        conditions = list(dict.fromkeys(r.condition for r in manifest.runs))
        seeds = list(dict.fromkeys(r.seed for r in manifest.runs))
        seeds = seeds[:race.seeds_cap(len(seeds))]
        saved = manifest.race.get("state") if manifest.race.get("plan") == asdict(race) \
            else None
        if saved and saved.get("conditions") == conditions and saved.get("seeds") == seeds:
            self.state = _read_state(saved)
        else:  # a new race (or, under --force, a new plan or matrix): it decides afresh
            self.state = new_race(conditions, seeds)
            for e in manifest.runs:
                if e.status == "skipped":
                    e.status = "pending"
        self._record()

    # ------------------------------------------------------------------ what may run

    def wanted(self) -> set[tuple[str, int]]:
        return {(c, s) for c, seeds in race_mod.wanted(self.state, self.race).items()
                for s in seeds}

    def released(self, entry: RunEntry) -> bool:
        return (entry.condition, entry.seed) in self.wanted()

    def next_round(self) -> tuple[list[RunEntry], list[str]]:
        """Once the released runs have all ended: the next decisions (several when the runs
        they release have already run, e.g. after --force). Returns the runs released (none
        when the race is over, or waits for a failed run's retry on the next launch) and what
        to say."""
        lines: list[str] = []
        while self.state.outcome == "racing":
            mine = [e for e in self.manifest.runs if self.released(e)]
            retry = [e for e in mine if e.status == "failed" and e.failures <= self.max_retries]
            if retry:
                lines.append(f"race: waits for {', '.join(e.name for e in retry)} (failed; run "
                             "the same command again to retry)")
            if retry or any(e.status not in ("completed", "failed") for e in mine):
                break
            self.state = race_mod.decide(self.state, self.race, self._values(mine),
                                         self.resolution)
            if self.state.outcome != "racing":
                for e in self.manifest.runs:
                    if e.status == "pending" and not self.released(e):
                        e.status = "skipped"
            self._record()
            lines += self.look_lines()
        return [e for e in self.manifest.runs if self.released(e) and e.status == "pending"], \
            lines

    def _values(self, runs: list[RunEntry]) -> dict[str, dict[int, float]]:
        """The race's figure of each completed run (a run without it is left out)."""
        values: dict[str, dict[int, float]] = {}
        for e in runs:
            v = race_value(self.run_dirs[e.name], self.race.metric,
                           self.race.threshold_value) if e.status == "completed" else None
            if v is not None:
                values.setdefault(e.condition, {})[e.seed] = v
        return values

    # ------------------------------------------------------------------ the manifest

    def _record(self) -> None:
        sched = race_mod.schedule(self.race, len(self.state.seeds), len(self.state.conditions))
        taken = race_mod.runs_taken(self.state, self.race)
        self.manifest.race = {
            "plan": asdict(self.race),
            "schedule": {"looks": list(sched.looks), "confidences": list(sched.confidences)},
            "outcome": self.state.outcome,
            "runs": {"taken": taken, "saved": race_mod.runs_saved(self.state, self.race),
                     "full": taken + race_mod.runs_saved(self.state, self.race)},
            "state": self.state.to_dict(),
        }

    def progress(self) -> str:
        """Where the race stands, in a few words."""
        runs = self.manifest.race["runs"]
        return (f"{self.race.metric} ({self.race.direction}), {len(self.state.looks)} "
                f"decision{'s' if len(self.state.looks) != 1 else ''} made, "
                f"{self.state.outcome}, {runs['taken']} of {runs['full']} runs")

    def look_lines(self) -> list[str]:
        """What the last decision did, in words."""
        if not self.state.looks:
            return []
        look = self.state.looks[-1]
        lines = [f"race: decision {look.number} after {len(look.seeds)} seeds "
                 f"(intervals at {race_mod.percent(look.confidence)} each)"]
        for c in look.eliminated:
            lines.append("race: " + standing_line(c, self.state.standings[c], self.race))
        lines += ["race: " + standing_line(c, s, self.race) for c, s in
                  self.state.standings.items() if s.state == "no_figures" and s.look == look.number]
        if self.state.outcome != "racing":
            lines += ["race: " + standing_line(c, s, self.race)
                      for c, s in self.state.standings.items()
                      if s.state not in ("eliminated", "no_figures")]
        runs = self.manifest.race["runs"]
        lines.append(f"race: {self.state.outcome}; {runs['taken']} of {runs['full']} runs "
                     f"({runs['saved']} saved so far)")
        return lines


def _read_state(saved: dict) -> RaceState:
    try:
        return read_state(saved)
    except RaceRecordError as exc:
        raise UserError(f"manifest.json's race cannot be read ({exc}); the run folders are "
                        "intact. Start a fresh campaign with --new") from None


def standing_line(name: str, s: race_mod.Standing, race: RacePlan) -> str:
    """One condition's state in words, with the interval that justified it."""
    if s.state == "no_figures":
        return (f"{name}: no figures at decision {s.look} (every run of it failed or has no "
                f"{race.metric}); it takes no more seeds")
    where = f"after {s.seeds} seed{'s' if s.seeds != 1 else ''}" if s.look else ""
    text = f"{name}: {s.state} {where}".rstrip()
    if s.why is not None:
        w = s.why
        text += (f" ({race.metric} {name} - {w.other} = {w.diff:+.3g} [{w.lo:+.3g}, "
                 f"{w.hi:+.3g}], paired t over seeds {', '.join(map(str, w.seeds))}, "
                 f"{race_mod.percent(w.confidence)} interval)")
    return text

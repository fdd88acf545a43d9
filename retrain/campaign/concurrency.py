"""The campaign's API concurrency under `[backend] max_concurrent = "auto"`: the runner's one
controller (`control/concurrency.py`), where it reads the campaign's usage and where it sets
the cap, its log and its saved state.

- Where the cap lives: the file semaphore's `cap` file in the slots folder (`FileCap`), or the
  Ray slot actor (`RayCap`). Both also give the usage every worker reported through its slots.
- Every INTERVAL_S the runner calls `tick`: the usage since the last tick becomes a `Sample`
  (mean calls in flight = slot-seconds / seconds; throughput = calls served / seconds), the
  controller decides, the cap is applied, and the decision is appended to
  `<campaign>/concurrency.jsonl` (time, cap, in_flight, throughput, completions_per_s,
  tokens_per_s, sigma, kappa, p_star, reason, ...).
- Until the first completions (every run still creating its session and model) nothing is
  observed: those calls are slow in a way the steps' calls are not.
- The fitted throughput is calls served per second, not completions: with a fixed batch both
  are proportional to the campaign's steps per second, but completions arrive in bursts (a
  step's samples end together), and a 3 s interval of a campaign whose steps take 13 s saw
  6.5 to 27 completions/s at one cap (bench/concurrency/campaign.py); calls end all along.
- The controller's state is saved to `<campaign>/concurrency_state.json` after every decision
  (atomically), so a runner killed with SIGKILL loses at most one interval, and a re-run starts
  from the learned cap.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Protocol

from retrain.config.sections import BackendConfig
from retrain.control.concurrency import ConcurrencyController, Decision, Sample
from retrain.runfiles import runlog, safejson
from retrain.slots.semaphore import Usage

INTERVAL_S = 3.0
START_CAP = 4                 # the first cap of a new campaign: today's fixed default
LOG_FILE = "concurrency.jsonl"
STATE_FILE = "concurrency_state.json"


class CapOwner(Protocol):
    """Where the campaign's cap lives and where its usage is reported."""

    def apply(self, cap: int) -> None: ...

    def usage(self) -> Usage: ...


class FileCap:
    """The file semaphore: the `cap` file and the workers' meter files in the slots folder."""

    def __init__(self, folder: Path):
        self.folder = folder

    def apply(self, cap: int) -> None:
        from retrain.slots.file_slots import write_cap

        write_cap(self.folder, cap)

    def usage(self) -> Usage:
        from retrain.slots.file_slots import usage_of

        return usage_of(self.folder)


class RayCap:
    """The Ray slot actor: it owns the cap and meters the calls."""

    def __init__(self, broker_name: str):
        self.name = broker_name
        self._broker: Any = None

    def _actor(self) -> Any:
        from retrain.slots.ray_slots import find_broker

        if self._broker is None:
            self._broker = find_broker(self.name)
        return self._broker

    def apply(self, cap: int) -> None:
        import ray

        ray.get(self._actor().resize.remote(cap), timeout=30)

    def usage(self) -> Usage:
        import ray

        return Usage.from_dict(ray.get(self._actor().stats.remote(), timeout=30).get("usage"))


class CampaignConcurrency:
    """One controller per campaign: measures, decides, applies, logs, saves."""

    def __init__(self, campaign_dir: Path, backend: BackendConfig, margin: float,
                 owner: CapOwner):
        self.dir = campaign_dir
        self.owner = owner
        self.ctl = ConcurrencyController(backend.max_concurrent_min, backend.max_concurrent_max,
                                         START_CAP, margin)
        self.resumed = self._load()
        self._last: tuple[float, Usage] | None = None
        self._next = 0.0

    @property
    def cap(self) -> int:
        return self.ctl.cap

    def _load(self) -> str:
        """Continue from the saved state, if any; returns what happened, for the runner's log."""
        path = self.dir / STATE_FILE
        if not path.exists():
            return ""
        try:
            self.ctl.load_state_dict(safejson.read_object(path))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"ignored {path.name} ({exc}); starting from cap {self.ctl.cap}"
        return f"continuing from the learned cap {self.ctl.cap} ({path.name})"

    def start(self) -> None:
        """Set the starting cap before any worker starts."""
        self.owner.apply(self.ctl.cap)

    def tick(self, now: float | None = None) -> Decision | None:
        """Decide when INTERVAL_S has passed since the last decision; None otherwise."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return None
        self._next = now + INTERVAL_S
        usage = self.owner.usage()
        last, self._last = self._last, (now, usage)
        if last is None or now <= last[0]:
            return None
        dt, d = now - last[0], usage - last[1]
        sample = Sample(in_flight=max(0.0, d.held_s) / dt, throughput=max(0, d.calls) / dt,
                        errors=max(0, d.errors))
        if last[1].completions == 0 and not sample.errors:  # start-up calls, not the curve
            decision = Decision(self.ctl.cap, "runs starting (no completions yet): hold",
                                self.ctl.phase)
            self._record(decision, sample, d, dt)
            return decision
        old = self.ctl.cap
        decision = self.ctl.observe(sample)
        if decision.cap != old:
            self.owner.apply(decision.cap)
        self._record(decision, sample, d, dt)
        return decision

    def _record(self, decision: Decision, s: Sample, d: Usage, dt: float) -> None:
        row = {"time": round(time.time(), 3), "cap": decision.cap,
               "in_flight": round(s.in_flight, 3), "throughput": round(s.throughput, 4),
               "completions_per_s": round(d.completions / dt, 3),
               "tokens_per_s": round(d.tokens / dt, 2),
               "errors": s.errors, "sigma": _num(decision.sigma), "kappa": _num(decision.kappa),
               "p_star": _num(decision.p_star), "phase": decision.phase,
               "reason": decision.reason}
        with open(self.dir / LOG_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        runlog.write_json_atomic(self.dir / STATE_FILE, self.ctl.state_dict())


def _num(v: float | None) -> float | str | None:
    """A coefficient for JSON: rounded, "inf" for no finite optimum, None for no fit."""
    if v is None:
        return None
    return round(v, 6) if math.isfinite(v) else "inf"


def last_decision(campaign_dir: str | Path, tail_bytes: int = 8192) -> dict | None:
    """The newest decision in `<campaign>/concurrency.jsonl` (its tail only), or None."""
    try:
        with open(Path(campaign_dir, LOG_FILE), "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - tail_bytes))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("cap"), int):
            return row
    return None


def read_decisions(campaign_dir: str | Path) -> list[dict]:
    """Every decision logged in `<campaign>/concurrency.jsonl` (bad lines skipped)."""
    rows = []
    try:
        text = Path(campaign_dir, LOG_FILE).read_text(encoding="utf-8")
    except OSError:
        return rows
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("cap"), int):
            rows.append(row)
    return rows

"""The campaign's API concurrency: one controller picks the cap on calls in flight across all
workers (`[backend] max_concurrent = "auto"`).

Pure: no I/O, no clock. Every interval the runner hands it a `Sample` (mean calls in flight,
served throughput, overload errors) and applies the `Decision`'s cap. In a campaign the USL's
p is literally the number of calls in flight, so the fit of `usl.py` applies as is:

- warm-up (slow start): from the starting cap, double while throughput rises by more than
  RISE (and calls really fill the cap), then fit the USL to what was seen;
- steady: the cap is `throttle_margin * p*` of the fit, moved only when the target leaves a
  hysteresis band; every PROBE_EVERY quiet intervals one interval probes above the cap, the
  next one below, so the fit keeps three or more concurrencies to stand on; a fit that sees
  no optimum (κ = 0) walks the cap up a step at a time;
- overload (HTTP 429/502/503/504 in the interval): the cap is cut multiplicatively at once
  (AIMD), a ceiling just below the overloaded cap holds until CEILING_HOLD quiet intervals pass
  (then it lifts by one: capacity may have come back), and the cap recovers by one a quiet
  interval up to the target;
- a change of the machine (RESET_AFTER intervals in a row off the fit by more than
  CHANGE_RATIO) forgets the old points and warms up again from the current cap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from retrain.control.usl import UslFit, UslSums

WINDOW = 60            # observations the fit sees
RISE = 1.10            # warm-up doubles while throughput grows by more than this factor
FILLED = 0.75          # warm-up doubles only while mean calls in flight reach this share of the cap
PROBE_EVERY = 6        # quiet steady intervals between probes
PROBE_STEP = 0.25      # a probe moves the cap by this share of it (at least 1)
BAND = 0.10            # hysteresis: the cap follows the target only beyond this share (at least 1)
CUT = 0.5              # AIMD: the cap's multiplier on an overload answer
CEILING_HOLD = 30      # quiet intervals before the ceiling set by an overload lifts by one
CHANGE_RATIO = 1.6     # observed / fitted throughput outside [1/r, r] counts as a change ...
RESET_AFTER = 3        # ... and this many in a row restart the warm-up
OVERLOAD_CODES = (429, 502, 503, 504)


@dataclass(frozen=True)
class Sample:
    """One interval of the campaign's API traffic, across all workers."""

    in_flight: float        # mean calls in flight (slot-seconds held / interval seconds)
    throughput: float       # served completions (or calls) per second
    errors: int = 0         # overload answers (429/502/503/504) in the interval


@dataclass(frozen=True)
class Decision:
    """The cap for the next interval, and why."""

    cap: int
    reason: str
    phase: str                       # warmup | steady | recover
    sigma: float | None = None
    kappa: float | None = None
    p_star: float | None = None      # None = no fit; inf = no finite optimum


def target_cap(fit: UslFit, margin: float, lo: int, hi: int) -> int:
    """throttle_margin * p*, within [lo, hi] (hi when the fit sees no optimum)."""
    p = fit.p_star
    return hi if not math.isfinite(p) else min(hi, max(lo, round(margin * p)))


class ConcurrencyController:
    """Picks the campaign's cap on API calls in flight, within [lo, hi]."""

    def __init__(self, lo: int, hi: int, start: int, margin: float = 0.85):
        if not 1 <= lo <= hi:
            raise ValueError(f"need 1 <= lo <= hi, got lo={lo}, hi={hi}")
        self.lo, self.hi, self.margin = lo, hi, margin
        self.cap = min(hi, max(lo, start))
        self._sums = UslSums(WINDOW, (lo + hi) / 2, max((hi - lo) / 2, 1.0))
        self.phase = "warmup"
        self.ceiling = hi
        self.target: int | None = None
        self.fit: UslFit | None = None
        self._best = 0.0          # warm-up: best throughput so far, at which cap
        self._best_cap = self.cap
        self._tried = 0           # warm-up: intervals seen
        self._down = 0            # warm-up: 1 once it halves below the start
        self._lowest = self.cap   # warm-up: the lowest cap tried
        self._quiet = 0           # steady intervals since the last probe
        self._probe = 0           # +1: next probe goes up, -1: down
        self._base = self.cap     # the cap a probe returns to
        self._calm = 0            # intervals since the last overload
        self._off = 0             # intervals in a row far off the fit

    # ------------------------------------------------------------------ one interval

    def observe(self, s: Sample) -> Decision:
        if s.errors > 0:
            return self._cut(s)
        self._calm += 1
        if self.ceiling < self.hi and self._calm % CEILING_HOLD == 0:
            self.ceiling += 1
        if not (s.in_flight > 0 and math.isfinite(s.in_flight) and s.throughput > 0
                and math.isfinite(s.throughput)):
            return self._say("no traffic in the interval: hold")
        if self._changed(s):
            self._sums.keep_newest(0)
            self._restart_warmup()
        p = max(1, round(s.in_flight))
        self._sums.add(p, p / s.throughput)
        if self.phase == "warmup":
            return self._warm(s)
        self._refit()
        if self.phase == "recover":
            return self._recover()
        return self._steady(s)

    def _restart_warmup(self) -> None:
        self.phase, self._best, self.fit, self.target = "warmup", 0.0, None, None
        self._best_cap = self._lowest = self.cap
        self._tried = self._down = 0

    def _warm(self, s: Sample) -> Decision:
        rose = s.throughput > RISE * self._best
        if s.throughput > self._best:
            self._best, self._best_cap = s.throughput, self.cap
        filled = s.in_flight >= FILLED * self.cap
        self._tried += 1
        if self._down == 0 and rose and filled and self.cap < min(self.hi, self.ceiling):
            self.cap = min(self.hi, self.ceiling, self.cap * 2)
            return self._say(f"warm-up: throughput {s.throughput:.3g}/s rose; try {self.cap}")
        first_move_failed = self._down == 0 and self._tried == 2 and not rose
        if (first_move_failed or (self._down and rose)) and self._lowest > self.lo:
            self._down = 1                      # the start was already past the optimum
            self._lowest = self.cap = max(self.lo, self._lowest // 2)
            return self._say(f"warm-up: throughput fell above the start; try {self.cap}")
        self.phase = "steady"
        why = "throughput stopped rising" if filled else \
            f"calls in flight {s.in_flight:.1f} do not fill the cap"
        self._refit()
        if self.fit is None:
            self.cap = self._best_cap
        return self._settle(f"warm-up done ({why})")

    def _steady(self, s: Sample) -> Decision:
        if self._probe and self.cap != self._base:     # a probe interval just ended
            self.cap = self._base
            return self._settle("probe done")
        self._quiet += 1
        if self._quiet >= PROBE_EVERY:
            self._quiet = 0
            return self._probe_once()
        return self._settle("")

    def _probe_once(self) -> Decision:
        step = max(1, round(PROBE_STEP * self.cap))
        self._probe = -1 if self._probe > 0 else 1
        self._base = self.cap
        to = min(self.hi, self.ceiling, self.cap + step) if self._probe > 0 else \
            max(self.lo, self.cap - step)
        if to == self.cap:
            return self._settle("")
        self.cap = to
        return self._say(f"probe {'up' if self._probe > 0 else 'down'} to {to}")

    def _settle(self, why: str) -> Decision:
        """Move to the fit's target when it leaves the hysteresis band (or walk up without one)."""
        prefix = f"{why}; " if why else ""
        if self.fit is None:
            return self._say(prefix + "no fit yet: hold")
        goal = min(self.target if self.target is not None else self.cap, self.ceiling)
        band = max(1, round(BAND * self.cap))
        if abs(goal - self.cap) > band or (why and goal != self.cap):
            old, self.cap = self.cap, goal
            self._base = self.cap
            return self._say(prefix + f"cap {old} -> {goal} (target "
                             f"{self.margin:g} x p* {self.fit.p_star:.3g})")
        self._base = self.cap
        return self._say(prefix + f"hold {self.cap} (target {goal} within the band)")

    def _cut(self, s: Sample) -> Decision:
        old = self.cap
        self.ceiling = max(self.lo, min(self.ceiling, max(old, round(s.in_flight)) - 1))
        self.cap = max(self.lo, min(self.ceiling, math.floor(old * CUT)))
        self._base, self._calm, self._probe, self._quiet = self.cap, 0, 0, 0
        if self.phase == "warmup":
            self._refit()
        self.phase = "recover"
        return self._say(f"overload: {s.errors} answer(s) 429/5xx at cap {old}; cut to "
                         f"{self.cap}, ceiling {self.ceiling}")

    def _recover(self) -> Decision:
        goal = min(self.ceiling, self.target if self.target is not None else self.ceiling)
        if self.cap < goal:
            self.cap += 1
            self._base = self.cap
            return self._say(f"recover: +1 to {self.cap} (toward {goal})")
        self.phase = "steady"
        return self._settle("recovered")

    # ------------------------------------------------------------------ the fit

    def _refit(self) -> None:
        fit = self._sums.fit()
        if isinstance(fit, UslFit):
            self.fit = fit
            self.target = target_cap(fit, self.margin, self.lo, self.hi)
            if not math.isfinite(fit.p_star):   # no optimum seen: walk up one step
                self.target = min(self.hi, max(self.target, self.cap + 1))
                self.target = min(self.target, self.cap + max(1, round(PROBE_STEP * self.cap)))

    def _changed(self, s: Sample) -> bool:
        if self.fit is None or self.phase == "warmup":
            return False
        ratio = s.throughput / max(self.fit.throughput(s.in_flight), 1e-300)
        self._off = self._off + 1 if not 1 / CHANGE_RATIO <= ratio <= CHANGE_RATIO else 0
        if self._off >= RESET_AFTER:
            self._off = 0
            return True
        return False

    def _say(self, reason: str) -> Decision:
        f = self.fit
        return Decision(self.cap, reason, self.phase, f.sigma if f else None,
                        f.kappa if f else None, f.p_star if f else None)

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict:
        """Everything a re-run needs to continue: the cap, the phase and the fit's points."""
        d = {k: getattr(self, k) for k in STATE_INTS + STATE_FLOATS + ("phase", "target")}
        return {**d, "sums": self._sums.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        """Continue from a saved state (a re-run of the campaign starts from its learned cap);
        the bounds are today's, so a cap saved outside them is clamped."""
        for k in STATE_INTS:
            setattr(self, k, int(d[k]))
        for k in STATE_FLOATS:
            setattr(self, k, float(d[k]))
        self.phase = d["phase"] if d["phase"] in ("warmup", "steady", "recover") else "steady"
        self.target = None if d["target"] is None else int(d["target"])
        for k in ("cap", "ceiling", "_base", "_best_cap", "_lowest"):
            setattr(self, k, min(self.hi, max(self.lo, getattr(self, k))))
        self._sums.load_state_dict(d["sums"])
        self._sums.center, self._sums.scale = (self.lo + self.hi) / 2, \
            max((self.hi - self.lo) / 2, 1.0)
        target = self.target
        self._refit()
        if target is not None and self.phase != "warmup":
            self.target = target


STATE_INTS = ("cap", "ceiling", "_best_cap", "_tried", "_down", "_lowest", "_quiet", "_probe",
              "_base", "_calm", "_off")
STATE_FLOATS = ("_best",)

"""The back-pressure controller's explorations: the warm-up sweep, repeating samples that
disagree, more steps while the fit cannot place p*, and re-exploring when the machine drifts.

Pure: no torch, no I/O. `Exploration` is mixed into `BackpressureController` and works on its
fields (its `_reset` sets them); the controller decides what an exploration's fit means.
"""

from __future__ import annotations

import math

from retrain.control import drift
from retrain.control.backpressure.decision import Decision
from retrain.control.roofline import Roofline
from retrain.control.usl import UslFit, doubling_sizes, sweep_sizes

TRANSIENT = 2.0            # an exploring sample this far off the others at its size: a transient
SE_GOAL = 0.07             # an exploration goes on until its fit locates p* to ±7% (one SE) ...
REFINES = 6                # ... or for at most this many more pairs of steps


class Exploration:
    """Which batch sizes an exploration steps through, and when it has seen enough. Uses the
    controller's `_decision`, `_decide`, `_bound`, `_goal` and `_set_fit`."""

    def _warmup_plan(self) -> list[int]:
        """The sweep's first k sizes, at least twice over and interleaved (a transient in one
        sample shows against the other), for at least warmup_steps + 1 steps: k is at least the
        doubling sizes and (warmup_steps + 1) / 2."""
        sizes = sweep_sizes(self.lo, self.hi)
        steps = self.config.warmup_steps + 1
        k = min(len(sizes), max(len(doubling_sizes(self.lo, self.hi)), math.ceil(steps / 2)))
        return (sizes[:k] * math.ceil(steps / k + 1))[:max(2 * k, steps)]

    def _plan(self) -> int:
        """The next exploration size (an out-of-memory retry does not use up a planned size)."""
        n = max(0, self._explore_n - self._retries)
        return self._bound(self._planned[min(n, len(self._planned) - 1)])

    def _plan_more(self, sizes: list[int]) -> None:
        self._planned += sizes
        self._explore_len += len(sizes)

    def _explore(self, b: int, p: int, roof: Roofline | None) -> Decision:
        self._explore_n += 1
        if self._explore_n < self._explore_len:
            return self._decision("hold", "warmup", self._plan(), p,
                                  f"exploring ({self._explore_n}/{self._explore_len - 1})")
        if not self._checked:
            self._checked = True
            again = self._sums.disagreeing(self._explore_n, TRANSIENT)
            if again:
                self._plan_more([q // self.group_size for q in again])
                return self._decision("hold", "warmup", self._plan(), p,
                                      f"repeating {len(again)} size(s) whose two samples "
                                      f"disagree by more than {TRANSIENT:g}x")
        dropped = self._sums.drop_transients(self._explore_n, TRANSIENT)
        fit = self._sums.fit()
        if isinstance(fit, str):
            if self.largest - self.lo < 2:
                return self._decision("hold", "warmup", self._bound(b), p,
                                      f"batch size range allows fewer than 3 sizes: {fit}")
            sweep = sweep_sizes(self.lo, self.largest)      # keep sweeping until a fit
            self._plan_more([sweep[len(self._planned) % len(sweep)]])
            return self._decision("hold", "warmup", self._plan(), p, f"exploring further: {fit}")
        refine = self._refine(fit)
        if refine:
            return self._decision("hold", "warmup", self._plan(), p, refine)
        self._set_fit(fit)
        self._exploring, self._land = False, True
        note = f"; {dropped} transient sample(s) left out" if dropped else ""
        self._refit_left = self._sums.window - len(self._sums)
        self._watch.cusum = drift.NO_DRIFT
        if self._watch.noise2 is None:
            self._watch.noise2 = drift.initial_noise2(fit, self._sums.points)
        return self._decide(b, p, roof, "first fit after exploring" + note, rule="first")

    def _refine(self, fit: UslFit) -> str:
        """While the fit locates p* worse than ±SE_GOAL (its standard error), plan two more
        steps, at half and twice its target, at most REFINES times; returns why ("" when
        done). The sweep and the drift probes are spread to find p* at all, not to place it
        precisely: at 10% noise the 8 drift probes put p* 18% low in some runs, and the many
        steps at the target that follow cannot move it (bench/RESULTS.md, 2026-11-25)."""
        if self._fit is None:        # the warm-up: its sweep spans the whole range already
            return ""
        se = self._sums.log_p_star_se(fit)
        if self._refines >= REFINES or se is None or se <= SE_GOAL:
            return ""
        self._refines += 1
        target = self._goal(fit).target
        self._plan_more([max(self.lo, target // 2), 2 * target])
        return (f"refining ({self._refines}/{REFINES}): p*={fit.p_star:.4g} ± {se:.0%}, "
                f"probing around the target {target}")

    def _start_probe(self, b: int, p: int, direction: int, since: int) -> Decision:
        """The machine changed: forget old data, probe sizes around b (drift.probe_sizes)."""
        self._planned = drift.probe_sizes(b, direction, self._bound) * 2
        self._checked, self._refines, self._ceiling_ok = False, 0, False   # asked at the refit
        self._sums.keep_newest(min(since, self._watch.n_at_p))   # only the new machine's data
        self._exploring, self._approaching, self._land = True, False, True
        self._explore_n, self._explore_len, self._retries = 0, len(self._planned), 0
        self._watch.cusum = drift.NO_DRIFT
        word = "faster" if direction > 0 else "slower"
        nxt = self._plan() if self._planned else b
        return self._decision("hold", "warmup", nxt, p,
                              f"throughput drifted {word} than the fit at p={p}: re-exploring")

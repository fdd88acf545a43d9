"""USL back-pressure: fit X(p) = λp / (1 + σ(p−1) + κp(p−1)) to step throughput, pick the batch.

Pure: no torch, no numpy, no I/O. `p = batch_size * group_size` (concurrency), X in tokens/s.
`p / X = a + b p + c p²` is a quadratic, so (σ, κ, λ) come from weighted least squares over a
sliding window of steps. With `objective = "goodput"` the target is also bounded by the
statistical efficiency of larger batches (Pollux). See docs/backpressure.md.
Its parts: `backpressure_explore` (the explorations), `regime_table` (where to go from a fit),
`backpressure_decision` (what it concludes), `backpressure_state` (saved and loaded).
"""

from __future__ import annotations

import dataclasses
import math
import operator

from retrain.control import drift
from retrain.control.backpressure import state as backpressure_state
from retrain.control.backpressure.decision import Decision, action_of
from retrain.control.backpressure.explore import Exploration
from retrain.control.goodput import goodput_batch, statistical_efficiency
from retrain.control.oom_ceiling import OomCeiling
from retrain.control.regime_table import Goal, Margins, classify, roofline_note, rule_reason
from retrain.control.roofline import Roofline, is_positive, roofline
from retrain.control.usl import WINDOW, UslFit, UslSums, observed_throughput, throughput_ratio
from retrain.control.work import StepWork, WorkModel

P_MAX = 10**7              # largest concurrency accepted as an observation
CEILING_Z = 2.0            # under an OOM ceiling, a target below it needs a fit this significant


def _as_batch(v: object) -> int | None:
    try:
        b = operator.index(v)
    except TypeError:
        return None
    return b if b >= 1 and not isinstance(v, bool) else None


# ---------------------------------------------------------------------------- the controller

class BackpressureController(Exploration):
    """Observes each step's throughput and proposes the next batch size (whole prompts).

    `base_batch_size` is the batch the learning rate was tuned for (`training.batch_size`):
    the goodput objective measures statistical efficiency relative to it."""

    def __init__(self, config, group_size: int, base_batch_size: int | None = None):
        g = _as_batch(group_size)
        if g is None:
            raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
        self.config = config
        self.group_size = g
        self.enabled = bool(config.enabled)
        self.lo = max(1, int(config.min_batch_size))
        self.hi = max(self.lo, int(config.max_batch_size))
        self.objective = getattr(config, "objective", "throughput")
        self.base_batch_size = _as_batch(base_batch_size) or self.lo
        self._reset()

    def _reset(self) -> None:
        lo_p, hi_p = self.lo * self.group_size, self.hi * self.group_size
        self._sums = UslSums(WINDOW, (lo_p + hi_p) / 2, max((hi_p - lo_p) / 2, 1.0))
        self._fit: UslFit | None = None
        self._steps = 0                    # valid observations so far
        self.oom_ceiling = OomCeiling()    # the run's one out-of-memory ceiling
        self._exploring = True
        self._explore_n = 0                # observations in the current exploration
        self._planned = self._warmup_plan()   # the exploration's batch sizes, in order
        self._explore_len = len(self._planned)
        self._retries = 0                  # out-of-memory retries in this exploration
        self._checked = False              # the exploration's samples were checked for transients
        self._refines = 0                  # pairs of steps added to locate p* more precisely
        self._ceiling_ok = False           # the data cannot reject a p* that targets the ceiling
        self._refit_left = 0               # refits left before the fit is frozen
        self._land = False                 # at the last refit, go to its target
        self._approaching = False          # the last increase was cut short by the bisection
        self._watch = drift.DriftWatch()   # smoothed throughput at this p, drift check
        self._work = WorkModel()           # step time from the step's work: throughput in work
        self._noise_scale: float | None = None  # gradient noise scale, in prompts
        self._regime = "warmup"
        self._next: int | None = None      # the last proposed batch size
        self._note = ""                    # said once, in front of the next reason

    # ------------------------------------------------------------------ public interface

    def first_batch_size(self, configured: int) -> int:
        """Batch size of step 1: the warm-up start when enabled, else `configured`."""
        if not self.enabled:
            return configured
        if self._next is not None:
            return self._next
        return self._plan() if self._exploring else self._bound(configured)

    def observe(self, batch_size: int, tokens: float, step_time_s: float, *, oom: bool = False,
                flops: float | None = None, bytes_moved: float | None = None,
                noise_scale: float | None = None, work: StepWork | None = None) -> Decision:
        """Record one step (or an out-of-memory failure) and decide the next batch size.

        `noise_scale`: the gradient noise scale in prompts (goodput); None = not measured.
        `work`: what the step did; with it, throughput is counted in work (retrain.control.work)
        rather than in `tokens`."""
        if not self.enabled:
            return self._disabled(batch_size, oom)
        if is_positive(noise_scale):
            self._noise_scale = float(noise_scale)
        b = _as_batch(batch_size)
        if b is None or b * self.group_size > P_MAX:
            return self._reject(self.lo, 0, f"batch_size={batch_size!r} is not usable")
        if oom:
            return self._out_of_memory(b)
        p = b * self.group_size
        x = observed_throughput(self._work_tokens(p, tokens, work, step_time_s), step_time_s)
        if isinstance(x, str):
            return self._reject(b, p, x)
        roof = roofline(flops, bytes_moved, step_time_s, self.config.peak_gflops,
                        self.config.peak_bw_gb_s)
        self._steps += 1
        self.oom_ceiling.ran(b)
        predicted = self._fit.throughput(p) if self._fit and not self._exploring else None
        self._watch.add(p, x, self.config.ema_decay)
        self._sums.add(p, p / x)
        d = self._explore(b, p, roof) if self._exploring else self._track(b, p, x, predicted, roof)
        return dataclasses.replace(d, step_throughput=x)

    def _work_tokens(self, p: int, tokens: float, work: StepWork | None,
                     step_time_s: float) -> float:
        """The step's work in tokens of the reference mix (`tokens` without a usable `work`)."""
        if work is None or not work.usable() or not is_positive(step_time_s):
            return tokens
        self._work.add(p, work, float(step_time_s))
        return self._work.equivalent_tokens(p, work)

    def state_dict(self) -> dict:
        """Everything needed to continue with the same fit and decisions (JSON-able); when
        disabled, only the out-of-memory ceiling ({} without one)."""
        ceiling = self.oom_ceiling
        if not self.enabled:
            return {} if ceiling.failed is None else {"ceiling": ceiling.failed}
        return backpressure_state.save(self)

    def load_state_dict(self, d: dict) -> bool:
        """Continue from `state_dict()`; a missing, foreign or broken state starts fresh.

        States saved by the previous version (running sums, a refit schedule) load too: the
        sums are recomputed from the saved points and the fit is refreshed at every step."""
        if not self.enabled:  # only the ceiling (a state saved with back-pressure has one too)
            self.oom_ceiling = OomCeiling(_as_batch(d.get("ceiling")) if d else None)
            return False
        self._reset()
        if not d or d.get("version") != backpressure_state.VERSION \
                or d.get("group_size") != self.group_size:
            self._note = "no usable saved controller state: starting a fresh warm-up"
            return False
        try:
            backpressure_state.load(self, d)
        except (KeyError, TypeError, ValueError) as exc:
            self._reset()
            self._note = f"saved controller state is broken ({exc!r}): starting a fresh warm-up"
            return False
        return True

    def adopt_oom_cap(self, cap: object, limit: int) -> None:
        """A resume point from before the controller owned the ceiling has the trainer's
        `oom_cap` (the largest batch size to use, applied only without back-pressure)."""
        if not self.enabled and isinstance(cap, int) and 1 <= cap <= limit:
            self.oom_ceiling.out_of_memory(cap + 1)

    # ------------------------------------------------------------------ bounds

    @property
    def largest(self) -> int:
        """Largest batch size the controller may propose (bounds and out-of-memory ceiling)."""
        return self.oom_ceiling.largest(self.lo, self.hi)

    @property
    def target_batch_size(self) -> int | None:
        """The current fit's target batch size (None before the first fit)."""
        return self._goal(self._fit).target if self._fit is not None else None

    def _bound(self, b: int) -> int:
        """b within the bounds; untested sizes under an out-of-memory ceiling by bisection."""
        return self.oom_ceiling.bound(b, self.lo, self.hi)

    def _goal(self, fit: UslFit) -> Goal:
        """Where `fit` says to go (regime_table.Goal).

        Throughput: throttle_margin * p* rounded down to whole prompts, within [lo, cap].
        Goodput: also no larger than the batch with the best throughput x efficiency."""
        tm, g = self.config.throttle_margin, self.group_size
        goal = tm * fit.p_star / g
        target = self.largest if goal >= self.largest or self._ceiling_ok \
            else max(self.lo, int(goal))
        if self.objective == "goodput" and self._noise_scale is not None:
            best = goodput_batch(fit, g, self.lo, self.largest, self._noise_scale,
                                 self.base_batch_size)
            if best < target:
                return Goal(best, float(best * g), "goodput")
        return Goal(target, tm * fit.p_star, "throughput")

    # ------------------------------------------------------------------ observation kinds

    def _decision(self, action: str, regime: str, b_next: int, p: int, reason: str) -> Decision:
        self._regime, self._next = regime, b_next
        if self._note:
            reason, self._note = f"{self._note}; {reason}", ""
        ema = self._watch.value() if self._watch.ema_p else None
        efficiency = goodput = None
        if self._noise_scale is not None and p:
            efficiency = statistical_efficiency(self._noise_scale, p / self.group_size,
                                                self.base_batch_size)
            goodput = None if ema is None else ema * efficiency
        fit = self._fit
        if fit is None:
            return Decision(action, regime, b_next, p, throughput=ema, reason=reason,
                            goodput=goodput, efficiency=efficiency)
        g = self.group_size
        peak_p = min(max(fit.p_star, self.lo * g), self.largest * g)
        util = None if ema is None else throughput_ratio(ema, fit.throughput(peak_p))
        return Decision(action, regime, b_next, p, fit.p_star, fit.sigma, fit.kappa, fit.lam,
                        util, ema, reason, goodput, efficiency)

    def _disabled(self, batch_size: int, oom: bool) -> Decision:
        """No back-pressure: the batch size that ran, below the out-of-memory ceiling (the
        trainer halves the batch after a failure)."""
        b = _as_batch(batch_size)
        if b is not None and oom:
            self.oom_ceiling.out_of_memory(b)
        elif b is not None:
            batch_size = self.oom_ceiling.largest(1, b)
        return Decision("hold", "disabled", batch_size)

    def _reject(self, b: int, p: int, why: str) -> Decision:
        nxt = self._bound(b)
        return self._decision(action_of(b, nxt), self._regime, nxt, p,
                              f"observation rejected: {why}; holding")

    def _out_of_memory(self, b: int) -> Decision:
        ceiling = self.oom_ceiling
        ceiling.out_of_memory(b)
        self._approaching = False
        retry = self._bound(ceiling.ok_max if ceiling.ok_max else b // 2)
        if self._exploring:
            self._retries += 1
            self._explore_len += 1
        why = f"out of memory at batch_size {b}: never proposing {ceiling.failed} or more"
        if b <= self.lo:
            why = f"out of memory at min_batch_size ({self.lo}): cannot go lower"
        return self._decision(action_of(b, retry), self._regime, retry, b * self.group_size, why)

    def _set_fit(self, fit: UslFit) -> None:
        """Use `fit`; under an out-of-memory ceiling, also ask whether its points can reject
        a p* high enough that the target is the largest size that fits. They often cannot:
        the steps below a ceiling far under p* cannot locate p* (the simulator's OOM at 10%
        noise: Cramér-Rao ±130%), and a fluke of their noise put the fit's p* at 83-96 for a
        true 221, throttling 7 -> 4 or 5 prompts (0.915 of the best). Then the target is the
        largest size that fits, as it would be for any p* the data allow."""
        self._fit = fit
        p_high = self.largest * self.group_size / self.config.throttle_margin  # target: largest
        self._ceiling_ok = (self.oom_ceiling.failed is not None and fit.p_star < p_high
                            and not self._sums.rejects_p_star_at_least(fit, p_high, CEILING_Z))

    def _track(self, b: int, p: int, x: float, predicted: float | None,
               roof: Roofline | None) -> Decision:
        """Refit while the window still holds the whole latest exploration (a window of one
        batch size cannot locate a peak), watch for drift, then apply the regime table."""
        note, rule = "", ""
        if self._refit_left > 0:
            self._refit_left -= 1
            fit = self._sums.fit()
            if isinstance(fit, str):
                note = f"keeping the previous fit ({fit})"
            else:
                self._set_fit(fit)
            if self._refit_left == 0 and self._land:
                rule, self._land = "landing", False   # the exploration's last refit
        if predicted:
            direction, since = self._watch.check(math.log(throughput_ratio(x, predicted)))
            if direction:
                return self._start_probe(b, p, direction, since)
        return self._decide(b, p, roof, note, rule)

    # ------------------------------------------------------------------ the regime table

    def _decide(self, b: int, p: int, roof: Roofline | None, note: str,
                rule: str = "") -> Decision:
        """Apply the regime table (regime_table.classify) within the bounds. `rule` "first"
        (right after exploring) or "landing" (at the last refit) always goes to the target: an
        exploration size, or a target set from a first fit of few points, is not an operating
        point worth holding."""
        fit = self._fit
        assert fit is not None
        goal = self._goal(fit)
        ratio = throughput_ratio(self._watch.value(), fit.throughput(p))
        margins = Margins(self.config.throttle_margin, self.config.increase_margin)
        regime, wanted, rule = classify(fit, b, p, ratio, roof, goal, margins, rule,
                                        self._approaching)
        nxt = self._bound(wanted)
        # Under an out-of-memory ceiling an increase goes by bisection; keep going on the next
        # steps (the hysteresis alone would stop it halfway).
        self._approaching = b < nxt < wanted
        action = "hold" if regime == "warmup" else action_of(b, nxt)
        why = rule_reason(rule, p, fit.p_star, ratio, goal.bound, margins)
        why += self._context(goal.bound, at_bound=wanted != b and nxt == b)
        if roof is not None:
            why += roofline_note(roof)
        return self._decision(action, regime, nxt, p, f"{note}; {why}" if note else why)

    def _context(self, bound: str, at_bound: bool) -> str:
        """What else shaped the target, said after the rule's reason."""
        why = ""
        if at_bound:
            why += " (at a batch size bound)"
        if self._ceiling_ok:
            why += (f"; target {self.largest}, the largest size that fits: below the "
                    "out-of-memory ceiling the steps cannot rule out a p* that high")
        if self.objective == "goodput":
            if self._noise_scale is None:
                why += "; target bound: throughput (gradient noise scale not measured yet)"
            else:
                why += (f"; target bound: {bound} (gradient noise scale "
                        f"{self._noise_scale:.3g} prompts)")
        return why

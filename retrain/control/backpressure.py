"""USL back-pressure: fit X(p) = λp / (1 + σ(p−1) + κp(p−1)) to step throughput, pick the batch.

Pure: no torch, no numpy, no I/O. `p = batch_size * group_size` (concurrency), X in tokens/s.
`p / X = a + b p + c p²` is a quadratic, so (σ, κ, λ) come from weighted least squares over a
sliding window of steps. With `objective = "goodput"` the target is also bounded by the
statistical efficiency of larger batches (Pollux). See docs/backpressure.md.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass

from retrain.control import drift
from retrain.control.goodput import goodput_batch, statistical_efficiency
from retrain.control.oom_ceiling import OomCeiling
from retrain.control.roofline import Roofline, is_positive, regime_from_fit, roofline
from retrain.control.usl import (
    WINDOW,
    UslFit,
    UslSums,
    doubling_sizes,
    observed_throughput,
    sweep_sizes,
    throughput_ratio,
    usl_p_star,
    usl_throughput,
)
from retrain.control.work import StepWork, WorkModel

# Re-exported for the tests, `plot` and the bench; the fit itself lives in `usl`.
__all__ = ["METRIC_KEYS", "BackpressureController", "Decision", "UslSums", "roofline",
           "sweep_sizes", "usl_p_star", "usl_throughput"]

P_MAX = 10**7              # largest concurrency accepted as an observation
TRANSIENT = 2.0            # an exploring sample this far off the others at its size: a transient
SE_GOAL = 0.07             # an exploration goes on until its fit locates p* to ±7% (one SE) ...
REFINES = 6                # ... or for at most this many more pairs of steps
CEILING_Z = 2.0            # under an OOM ceiling, a target below it needs a fit this significant

METRIC_KEYS = ("bp_action", "bp_regime", "bp_p_star", "bp_sigma", "bp_kappa", "bp_lambda",
               "bp_utilization", "bp_throughput", "bp_p", "bp_goodput", "bp_efficiency",
               "bp_step_throughput")


# ---------------------------------------------------------------------------- decisions


@dataclass(frozen=True)
class Decision:
    """What the controller concluded from one step; `batch_size` is for the next step."""

    action: str                        # hold | throttle | increase
    regime: str                        # warmup | retrograde | memory_bound | compute_bound | ...
    batch_size: int
    p: int = 0                         # concurrency of the observed step
    p_star: float | None = None        # None = no fit yet; inf = no finite optimum (κ = 0)
    sigma: float | None = None
    kappa: float | None = None
    lam: float | None = None           # tokens/s at p = 1
    utilization: float | None = None   # smoothed throughput / fitted peak within the bounds
    throughput: float | None = None    # EMA-smoothed tokens/s at the current p
    reason: str = ""
    goodput: float | None = None       # throughput x efficiency (needs the noise scale)
    efficiency: float | None = None    # statistical efficiency of the observed batch size
    step_throughput: float | None = None   # this step's throughput as the controller read it

    def metrics(self) -> dict:
        """The bp_* keys for metrics.jsonl (finite numbers or None; {} when disabled)."""
        if self.regime == "disabled":
            return {}
        return {"bp_action": self.action, "bp_regime": self.regime,
                "bp_p_star": _finite(self.p_star), "bp_sigma": _finite(self.sigma),
                "bp_kappa": _finite(self.kappa), "bp_lambda": _finite(self.lam),
                "bp_utilization": _finite(self.utilization),
                "bp_throughput": _finite(self.throughput), "bp_p": self.p,
                "bp_goodput": _finite(self.goodput), "bp_efficiency": _finite(self.efficiency),
                "bp_step_throughput": _finite(self.step_throughput)}


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def _action(b: int, nxt: int) -> str:
    return "throttle" if nxt < b else "increase" if nxt > b else "hold"


def _as_batch(v: object) -> int | None:
    try:
        b = operator.index(v)
    except TypeError:
        return None
    return b if b >= 1 and not isinstance(v, bool) else None



# ---------------------------------------------------------------------------- the controller

class BackpressureController:
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
        fit = self._fit
        return {"version": 1, "group_size": self.group_size, "steps": self._steps,
                "sums": self._sums.state_dict(),
                "fit": [fit.sigma, fit.kappa, fit.lam] if fit else None,
                "ceiling": ceiling.failed, "ok_max": ceiling.ok_max,
                "exploring": self._exploring, "explore_n": self._explore_n,
                "explore_len": self._explore_len, "retries": self._retries,
                "probes": list(self._planned), "checked": self._checked, "refines": self._refines,
                "ceiling_ok": self._ceiling_ok,
                "refit_left": self._refit_left, "land": self._land,
                "approaching": self._approaching, **self._watch.state_dict(),
                "noise_scale": self._noise_scale, "regime": self._regime, "next": self._next,
                "work": self._work.state_dict()}

    def load_state_dict(self, d: dict) -> bool:
        """Continue from `state_dict()`; a missing, foreign or broken state starts fresh.

        States saved by the previous version (running sums, a refit schedule) load too: the
        sums are recomputed from the saved points and the fit is refreshed at every step."""
        if not self.enabled:  # only the ceiling (a state saved with back-pressure has one too)
            self.oom_ceiling = OomCeiling(_as_batch(d.get("ceiling")) if d else None)
            return False
        self._reset()
        if not d or d.get("version") != 1 or d.get("group_size") != self.group_size:
            self._note = "no usable saved controller state: starting a fresh warm-up"
            return False
        try:
            self._load(d)
        except (KeyError, TypeError, ValueError) as exc:
            self._reset()
            self._note = f"saved controller state is broken ({exc!r}): starting a fresh warm-up"
            return False
        return True

    def _load(self, d: dict) -> None:
        def optional_int(v: object) -> int | None:
            return None if v is None else int(v)

        self._sums.load_state_dict(d["sums"])
        self._fit = UslFit(*map(float, d["fit"])) if d["fit"] else None
        self._steps = int(d["steps"])
        self.oom_ceiling = OomCeiling(optional_int(d["ceiling"]), optional_int(d["ok_max"]))
        self._next = optional_int(d["next"])
        self._exploring = bool(d["exploring"])
        self._explore_n, self._explore_len = int(d["explore_n"]), int(d["explore_len"])
        self._retries = int(d["retries"])
        # States saved before the warm-up plan was kept have [] there: the warm-up sweep.
        self._planned = [int(v) for v in d["probes"]] or self._warmup_plan()
        self._checked = bool(d.get("checked", False))
        self._refines = int(d.get("refines", 0))
        self._ceiling_ok = bool(d.get("ceiling_ok", False))
        self._refit_left = int(d["refit_left"])
        self._approaching = bool(d.get("approaching", False))
        self._land = bool(d.get("land", False))
        self._watch = drift.DriftWatch.from_state(d)
        self._work = WorkModel.from_state(d.get("work"))
        scale = d.get("noise_scale")
        self._noise_scale = float(scale) if is_positive(scale) else None
        self._regime = str(d["regime"])

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
        return self._goal(self._fit)[0] if self._fit is not None else None

    def _bound(self, b: int) -> int:
        """b within the bounds; untested sizes under an out-of-memory ceiling by bisection."""
        return self.oom_ceiling.bound(b, self.lo, self.hi)

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

    def _goal(self, fit: UslFit) -> tuple[int, float, str]:
        """(target batch size, target concurrency, which bound set it).

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
                return best, float(best * g), "goodput"
        return target, tm * fit.p_star, "throughput"

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
        return self._decision(_action(b, nxt), self._regime, nxt, p,
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
        return self._decision(_action(b, retry), self._regime, retry, b * self.group_size, why)

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
        target = self._goal(fit)[0]
        self._plan_more([max(self.lo, target // 2), 2 * target])
        return (f"refining ({self._refines}/{REFINES}): p*={fit.p_star:.4g} ± {se:.0%}, "
                f"probing around the target {target}")

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
        """The seed's regime table. `rule` "first" (right after exploring) or "landing" (at the
        last refit) always goes to the target: an exploration size, or a target set from a
        first fit of few points, is not an operating point worth holding."""
        fit = self._fit
        assert fit is not None
        target, goal_p, bound = self._goal(fit)
        ratio = throughput_ratio(self._watch.value(), fit.throughput(p))
        tm, im = self.config.throttle_margin, self.config.increase_margin
        if fit.kappa > 0 and p > tm * fit.p_star:
            regime, nxt, rule = "retrograde", target, "retrograde"
        else:
            regime = roof.regime if roof is not None else regime_from_fit(ratio)
            if rule:
                nxt = target
            elif regime == "warmup":
                nxt, rule = b, "overestimates"
            elif bound == "goodput" and b > target:
                nxt, rule = target, "goodput"
            elif p < im * goal_p:
                nxt, rule = target, "below"
            elif self._approaching and target > b:
                nxt, rule = target, "approaching"
            else:
                nxt = b
        wanted = nxt
        nxt = self._bound(nxt)
        # Under an out-of-memory ceiling an increase goes by bisection; keep going on the next
        # steps (the hysteresis alone would stop it halfway).
        self._approaching = b < nxt < wanted
        action = "hold" if regime == "warmup" else _action(b, nxt)
        why = self._explain(rule, p, ratio, bound, at_bound=wanted != b and nxt == b, roof=roof)
        return self._decision(action, regime, nxt, p, f"{note}; {why}" if note else why)

    def _explain(self, rule: str, p: int, ratio: float, bound: str, at_bound: bool,
                 roof: Roofline | None) -> str:
        tm, im = self.config.throttle_margin, self.config.increase_margin
        where = f"p={p}, p*={self._fit.p_star:.4g}, throughput {ratio:.0%} of the fit"
        target = f"{tm} * p*" if bound == "throughput" else "the goodput bound"
        why = {"retrograde": f"p > {tm} * p* ({where})",
               "first": f"moving to {target} after exploring ({where})",
               "landing": f"last refit after exploring: landing on {target} ({where})",
               "overestimates": f"fit overestimates this point ({where}): holding",
               "goodput": f"above the goodput bound: larger batches stop helping ({where})",
               "below": f"below target: p < {im} * {target} ({where})",
               "approaching": f"approaching {target} below the out-of-memory ceiling ({where})",
               }.get(rule, where)
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
        if roof is not None:
            why += (f"; roofline: {roof.intensity:.3g} FLOP/B vs balance {roof.balance:.3g}, "
                    f"{roof.compute_fraction:.0%} of peak FLOP/s, "
                    f"{roof.memory_fraction:.0%} of peak bandwidth")
        return why

    # ------------------------------------------------------------------ drift

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

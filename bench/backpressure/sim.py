"""Drive the back-pressure controller against simulated machines and print how it does.

    python bench/backpressure/sim.py [--seeds 20] [--steps 300]

Each machine follows the USL exactly, X(p) = λp / (1 + σ(p−1) + κp(p−1)) tokens/s, times
log-normal noise exp(noise * N(0,1)) per step ("1 in 25 slow": every 25th step also takes 3x
as long, like a checkpoint save). Steps run at batch_size * group_size = p sequences of
TOKENS_PER_SEQ tokens; step_time_s = tokens / X. Per scenario (over seeds):

- settle: decisions after warm-up until the batch size stays within ±10% of where the phase
  ends (1 = the first fitted decision already lands there);
- final p / target: the phase's final p over the target, throttle_margin * p* rounded down to
  whole prompts (groups are never split) and capped by the bounds and the out-of-memory limit;
  with group_size 16 and small p* that rounding alone can be 15% below throttle_margin * p*;
- thr50: mean true throughput (noise-free X at the chosen p) over the last 50 steps, as a
  fraction of the best X over every allowed batch size;
- dirchg: sign changes of the batch-size moves after settling;
- recovery: steps after a hardware change until the batch size settles again;
- OOMs: out-of-memory failures reported to the controller;
- p/own: the final batch size over the controller's own target (that of its last fit): 1.00
  when it landed on what its own refit asks for (not held below it by the hysteresis);
- alarms: drift alarms (re-explorations) the simulated machine did not cause, summed over all
  seeds: pure noise crossing the CUSUM limit (one per hardware change is expected and not
  counted; in the RL scenarios the machine never changes, so every alarm counts). Each
  costs a few steps at probe sizes, and shows in `settle`'s worst seed;
- us/obs: mean wall time of one `observe` call (noisy on a shared machine; the header prints
  how long `sum(range(1000))` takes here, to compare machines);
- SE 1st/win/best: how precisely the data can locate p* at all. The Cramér-Rao bound on the
  standard error of log p* (0.10 = ±10%) for the steps of the warm-up sweep (what the first
  decision rests on), for the first 100 steps (the window of the last refit), and for the best
  possible placement of 100 steps within the allowed batch sizes. No unbiased estimator does
  better, so a final p within 10% of the target needs these well under 0.10.

"RL completions /2": the machine does not change, but from step 150 the completions are half
as long (see `rl_work`), as when a policy learns; the controller gets each step's `StepWork`.
"same, tokens only" feeds it the sampled tokens alone, as the controller was fed before.

Cells show the median over seeds and, after a slash, the worst seed.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
import timeit
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from retrain.config.sections import BackpressureConfig  # noqa: E402
from retrain.control.backpressure.controller import BackpressureController  # noqa: E402
from retrain.control.usl import usl_p_star, usl_throughput  # noqa: E402
from retrain.control.work import StepWork  # noqa: E402

TOKENS_PER_SEQ = 300
GROUP = 16
WINDOW = 100            # the controller's fit window
SLOW_STEP = 3.0         # how much longer a one-off slow step takes


@dataclass
class Scenario:
    name: str
    usl: tuple[float, float, float]                  # (σ, κ, λ)
    noise: float = 0.0
    after: tuple[float, float, float] | None = None  # the machine from change_at on
    change_at: int = 150
    oom_at: int | None = None                        # batch sizes >= this run out of memory
    slow_every: int | None = None                    # every n-th step takes 3x as long
    steps: int = 300
    halve_at: int | None = None          # RL drift: completions halve here, machine unchanged
    raw_tokens: bool = False             # feed sampled tokens only (no StepWork), as before


@dataclass
class Result:
    settle: list[float] = field(default_factory=list)
    ratio: list[float] = field(default_factory=list)
    thr: list[float] = field(default_factory=list)
    dirchg: list[float] = field(default_factory=list)
    recovery: list[float] = field(default_factory=list)
    ratio2: list[float] = field(default_factory=list)
    own: list[float] = field(default_factory=list)
    ooms: list[float] = field(default_factory=list)
    us: list[float] = field(default_factory=list)
    false_alarms: list[int] = field(default_factory=list)
    se_first: list[float] = field(default_factory=list)
    se_window: list[float] = field(default_factory=list)


def _solve3(m: list[list[float]], r: list[float]) -> list[float] | None:
    """Solve a 3x3 system by Gaussian elimination with partial pivoting (None if singular)."""
    a = [row[:] + [v] for row, v in zip(m, r, strict=True)]
    for i in range(3):
        k = max(range(i, 3), key=lambda j: abs(a[j][i]))
        if a[k][i] == 0.0:
            return None
        a[i], a[k] = a[k], a[i]
        for j in range(i + 1, 3):
            f = a[j][i] / a[i][i]
            a[j] = [x - f * y for x, y in zip(a[j], a[i], strict=True)]
    x = [0.0, 0.0, 0.0]
    for i in (2, 1, 0):
        x[i] = (a[i][3] - sum(a[i][j] * x[j] for j in range(i + 1, 3))) / a[i][i]
    return x


def _log_p_star_rows(ps: list[int], usl) -> tuple[list[list[float]], list[float]] | None:
    """Rows d log y / d(a, b', c') at each p and the gradient of log p*, where y = p/X =
    a + b' q + c' q² with q = p / 1000 (scaled for conditioning); None when p* is unbounded."""
    sigma, kappa, lam = usl
    if kappa <= 0.0 or sigma >= 1.0:
        return None
    a, b, c = (1 - sigma) / lam, (sigma - kappa) / lam * 1e3, kappa / lam * 1e6
    rows = []
    for p in ps:
        q = p / 1e3
        y = a + b * q + c * q * q
        rows.append([1 / y, q / y, q * q / y])
    return rows, [0.5 / a, 0.0, -0.5 / c]          # log p* = (log a - log c') / 2 + const


def p_star_se(ps: list[int], usl, noise: float) -> float | None:
    """Cramér-Rao bound on the standard error of log p* from one step at each concurrency in
    `ps` (log-normal noise): no unbiased estimator does better with these steps."""
    got = _log_p_star_rows(ps, usl)
    if got is None or noise <= 0.0:
        return None
    rows, g = got
    info = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    x = _solve3(info, g)
    if x is None:
        return None
    return noise * math.sqrt(max(0.0, sum(u * v for u, v in zip(g, x, strict=True))))


def best_design(sizes: list[int], usl, noise: float, n: int):
    """The bound for the best placement of n steps over `sizes` (concurrencies), as
    (bound, three sizes, steps at each, fractional). Three coefficients need at most three
    distinct sizes (Elfving); for sizes (p1, p2, p3) and h = J^-T g the variance is least with
    n_i ∝ |h_i|, and is then noise² (Σ|h_i|)² / n."""
    if _log_p_star_rows([], usl) is None or noise <= 0.0:
        return None
    best = None
    for i, p1 in enumerate(sizes):
        for j in range(i + 1, len(sizes)):
            for p3 in sizes[j + 1:]:
                rows, g = _log_p_star_rows([p1, sizes[j], p3], usl)
                h = _solve3([list(col) for col in zip(*rows, strict=True)], g)
                if h is not None:
                    total = sum(abs(v) for v in h)
                    se = noise * total / math.sqrt(n)
                    if best is None or se < best[0]:
                        best = (se, (p1, sizes[j], p3), tuple(n * abs(v) / total for v in h))
    return best


def best_batch(usl, cfg: BackpressureConfig, oom_at: int | None) -> tuple[int, float]:
    hi = cfg.max_batch_size if oom_at is None else min(cfg.max_batch_size, oom_at - 1)
    xs = {b: usl_throughput(b * GROUP, *usl) for b in range(cfg.min_batch_size, hi + 1)}
    b = max(xs, key=xs.get)
    return b, xs[b]


def target_p(usl, cfg: BackpressureConfig, oom_at: int | None) -> float:
    """throttle_margin * p* rounded down to whole prompts, within the bounds and under OOM."""
    hi = cfg.max_batch_size if oom_at is None else min(cfg.max_batch_size, oom_at - 1)
    goal = cfg.throttle_margin * usl_p_star(usl[0], usl[1]) / GROUP
    b = hi if math.isinf(goal) else int(goal)
    return min(max(b, cfg.min_batch_size), hi) * GROUP


def settle_index(batches: list[int]) -> int | None:
    """First index from which every batch stays within ±10% of the last one."""
    final = batches[-1]
    idx = len(batches)
    for i in range(len(batches) - 1, -1, -1):
        if abs(batches[i] - final) > 0.1 * final:
            break
        idx = i
    return idx if idx < len(batches) else None


def direction_changes(batches: list[int]) -> int:
    signs = [1 if b > a else -1 for a, b in zip(batches, batches[1:], strict=False) if b != a]
    return sum(1 for a, b in zip(signs, signs[1:], strict=False) if a != b)


def run(sc: Scenario, seed: int, cfg: BackpressureConfig, res: Result) -> None:
    rng, wrng = random.Random(seed), random.Random(seed + 1000)
    ctl = BackpressureController(cfg, GROUP)
    b = ctl.first_batch_size(8)
    batches, ooms, spent, calls, alarms, warm = [], 0, 0.0, 0, [], None
    for step in range(sc.steps):
        usl = sc.after if sc.after is not None and step >= sc.change_at else sc.usl
        while sc.oom_at is not None and b >= sc.oom_at:
            t0 = time.perf_counter()
            b = ctl.observe(b, 0, 0.0, oom=True).batch_size
            spent, calls, ooms = spent + time.perf_counter() - t0, calls + 1, ooms + 1
        x = usl_throughput(b * GROUP, *usl) * math.exp(sc.noise * rng.gauss(0.0, 1.0))
        if sc.slow_every and step % sc.slow_every == sc.slow_every - 1:
            x /= SLOW_STEP     # a checkpoint save, a GC pause, a hiccup of a hosted API
        tokens, seconds, work = rl_work(sc, step, b * GROUP, x, wrng)
        t0 = time.perf_counter()
        d = ctl.observe(b, tokens, seconds, work=None if sc.raw_tokens else work)
        spent, calls = spent + time.perf_counter() - t0, calls + 1
        batches.append(b)
        b = d.batch_size
        if "drifted" in d.reason:
            alarms.append(step)
        if warm is None and d.regime != "warmup":
            warm = step + 1                       # steps that ran at warm-up sizes
    end1 = sc.change_at if sc.after is not None else sc.steps
    phase1 = batches[warm:end1]
    s = settle_index(phase1)
    res.settle.append(math.inf if s is None else s + 1)
    res.ratio.append(phase1[-1] * GROUP / target_p(sc.usl, cfg, sc.oom_at))
    post = phase1[s:] if s is not None else phase1
    res.dirchg.append(direction_changes(post))
    final_usl = sc.after or sc.usl
    _, best = best_batch(final_usl, cfg, sc.oom_at)
    last = batches[-50:]
    res.thr.append(statistics.fmean(usl_throughput(v * GROUP, *final_usl) for v in last) / best)
    if sc.after is not None:
        phase2 = batches[sc.change_at:]
        s2 = settle_index(phase2)
        res.recovery.append(math.inf if s2 is None else s2)
        res.ratio2.append(phase2[-1] * GROUP / target_p(sc.after, cfg, sc.oom_at))
        res.dirchg[-1] += direction_changes(phase2[s2:] if s2 is not None else phase2)
    res.ooms.append(ooms)
    own = ctl.target_batch_size
    if own is not None:
        res.own.append(batches[-1] / own)
    # Drift alarms the machine did not cause: all of them, less one after a hardware change.
    caused = sc.after is not None and any(a >= sc.change_at for a in alarms)
    res.false_alarms.append(len(alarms) - caused)
    res.us.append(spent / calls * 1e6)
    for key, steps in (("se_first", batches[:warm]), ("se_window", batches[:WINDOW])):
        se = p_star_se([v * GROUP for v in steps], sc.usl, sc.noise)
        if se is not None:
            getattr(res, key).append(se)


def rl_work(sc: Scenario, step: int, p: int, x: float,
            rng: random.Random) -> tuple[int, float, StepWork | None]:
    """(sampled tokens, step time, work) of a step at p on a machine doing x tokens/s of the
    reference mix (TOKENS_PER_SEQ: 100 prompt + 200 completion tokens per sequence). With
    `halve_at`, completions vary by 15% a step and halve from that step on; 60% of a step's
    cost does not depend on their length (prompt, per-step costs), 40% does."""
    if sc.halve_at is None:
        tokens = p * TOKENS_PER_SEQ
        return tokens, tokens / x, None
    c = (200 if step < sc.halve_at else 100) * math.exp(0.15 * rng.gauss(0.0, 1.0))
    work = StepWork(prompt_tokens=100 * p, completion_tokens=round(c * p))
    return work.sampled_tokens, p * TOKENS_PER_SEQ / x * (0.6 + 0.4 * c / 200), work


def scenarios() -> list[Scenario]:
    a, b, c = (0.02, 2e-5, 900.0), (0.10, 5e-6, 700.0), (0.30, 1e-4, 1200.0)
    return [
        Scenario("retro A p*=221", a),
        Scenario("retro B p*=424", b),
        Scenario("retro C p*=84", c),
        Scenario("linear k=0", (0.05, 0.0, 800.0)),
        Scenario("A noise 5%", a, noise=0.05),
        Scenario("A noise 10%", a, noise=0.10),
        Scenario("A noise 20%", a, noise=0.20),
        Scenario("A 5%, 1 in 25 slow", a, noise=0.05, slow_every=25),
        Scenario("B noise 10%", b, noise=0.10),
        Scenario("hw p* 221->111 5%", a, noise=0.05, after=(0.02, 8e-5, 900.0)),
        Scenario("hw p* 111->221 5%", (0.02, 8e-5, 900.0), noise=0.05, after=a),
        Scenario("hw lam x0.6 5%", a, noise=0.05, after=(0.02, 2e-5, 540.0)),
        Scenario("hw p* 221->111 10%", a, noise=0.10, after=(0.02, 8e-5, 900.0)),
        Scenario("hw sigma x4 5%", (0.05, 1e-4, 900.0), noise=0.05,
                 after=(0.20, 1e-4, 900.0)),
        Scenario("OOM b>=8 (A, p*=221)", a, oom_at=8),
        Scenario("OOM b>=8 (A), 10%", a, noise=0.10, oom_at=8),
        Scenario("OOM b>=16 (B, p*=424)", b, oom_at=16),
        Scenario("RL completions /2 5%", a, noise=0.05, halve_at=150),
        Scenario("  same, tokens only", a, noise=0.05, halve_at=150, raw_tokens=True),
    ]


def cell(vals: list[float], fmt: str, worst=max) -> str:
    if not vals:
        return "-"
    med, bad = statistics.median(vals), worst(vals)

    def f(v: float) -> str:
        return "never" if math.isinf(v) else format(v, fmt)

    return f(med) if med == bad else f"{f(med)}/{f(bad)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    cfg = BackpressureConfig(enabled=True)
    head = (f"{'scenario':22} {'settle':>8} {'p/target':>11} {'thr50':>11} {'dirchg':>6} "
            f"{'recovery':>8} {'p2/tgt2':>11} {'p/own':>9} {'OOMs':>5} {'alarms':>6} "
            f"{'us/obs':>7} "
            f"{'SE 1st/win/best':>16}")
    print(f"{args.seeds} seeds x {args.steps} steps, group_size={GROUP}, "
          f"batch {cfg.min_batch_size}..{cfg.max_batch_size}, warmup_steps={cfg.warmup_steps}")
    ref = min(timeit.repeat("sum(range(1000))", number=2000, repeat=5)) / 2000 * 1e6
    print(f"this machine's Python speed: sum(range(1000)) takes {ref:.1f} us")
    print(head)
    print("-" * len(head))
    for sc in scenarios():
        sc.steps = args.steps
        res = Result()
        for seed in range(args.seeds):
            run(sc, seed, cfg, res)
        far = lambda v: max(v, key=lambda r: abs(r - 1.0))  # noqa: E731
        print(f"{sc.name:22} {cell(res.settle, '.0f'):>8} {cell(res.ratio, '.2f', far):>11} "
              f"{cell(res.thr, '.3f', min):>11} {cell(res.dirchg, '.0f'):>6} "
              f"{cell(res.recovery, '.0f'):>8} {cell(res.ratio2, '.2f', far):>11} "
              f"{cell(res.own, '.2f', far):>9} "
              f"{cell(res.ooms, '.0f'):>5} {sum(res.false_alarms):>6} "
              f"{statistics.median(res.us):>7.1f} "
              f"{se_cell(res, sc, cfg):>16}")


_BEST_SE: dict = {}


def se_cell(res: Result, sc: Scenario, cfg: BackpressureConfig) -> str:
    """Median bounds for the warm-up and for the refits' window, then the best 100 steps."""
    if not res.se_first:
        return "-"
    hi = cfg.max_batch_size if sc.oom_at is None else min(cfg.max_batch_size, sc.oom_at - 1)
    key = (sc.usl, cfg.min_batch_size, hi)
    if key not in _BEST_SE:          # the bound is proportional to the noise: compute it once
        sizes = [b * GROUP for b in range(cfg.min_batch_size, hi + 1)]
        design = best_design(sizes, sc.usl, 1.0, WINDOW)
        _BEST_SE[key] = None if design is None else design[0]
    best = _BEST_SE[key]
    return (f"{statistics.median(res.se_first):.2f}/{statistics.median(res.se_window):.2f}/"
            + ("-" if best is None else f"{best * sc.noise:.2f}"))


if __name__ == "__main__":
    main()

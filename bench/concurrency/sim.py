"""Drive the campaign concurrency controller against simulated endpoints and print how it does.

    python bench/concurrency/sim.py [--seeds 20] [--intervals 200]

Each endpoint serves X(p) = λp / (1 + σ(p−1) + κp(p−1)) completions/s with p calls in flight,
times (1 + noise * N(0,1)) per interval; demand is unlimited (calls fill the cap), unless a
scenario caps it. An endpoint with `fail_above = F` answers 502 to calls beyond F+1 in flight:
those intervals report the errors and serve only X(F+1) / 2 (the rest was retries). A
scenario may change the curve half-way (contention x4).

Per scenario (over seeds): share = mean served throughput over the last half of the
intervals (after the change, where there is one) as a fraction of the best fixed cap's X;
final cap and the best fixed cap; error intervals (how often the cap was above fail_above).
Cells show the median over seeds and, after a slash, the worst seed.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from retrain.control.concurrency import ConcurrencyController, Sample  # noqa: E402
from retrain.control.usl import usl_throughput  # noqa: E402


@dataclass(frozen=True)
class Endpoint:
    sigma: float
    kappa: float
    lam: float = 10.0
    fail_above: int | None = None
    demand: int | None = None           # calls the campaign has to send at once (None: any)

    def served(self, cap: int, rng: random.Random, noise: float) -> Sample:
        p = cap if self.demand is None else min(cap, self.demand)
        errors = 0
        if self.fail_above is not None and p > self.fail_above + 1:
            errors, p_ok = p - self.fail_above - 1, self.fail_above + 1
            x = usl_throughput(p_ok, self.sigma, self.kappa, self.lam) / 2
        else:
            x = usl_throughput(p, self.sigma, self.kappa, self.lam)
        return Sample(in_flight=float(p), throughput=max(1e-9, x * (1 + noise * rng.gauss(0, 1))),
                      errors=errors)

    def best(self, lo: int, hi: int) -> tuple[int, float]:
        top = hi if self.demand is None else min(hi, self.demand)
        if self.fail_above is not None:
            top = min(top, self.fail_above + 1)
        caps = range(lo, max(lo, top) + 1)
        xs = {c: usl_throughput(c, self.sigma, self.kappa, self.lam) for c in caps}
        c = max(xs, key=xs.get)
        return c, xs[c]

    def true_x(self, cap: int) -> float:
        return self.served(cap, random.Random(0), 0.0).throughput


def kappa_for(p_star: float, sigma: float) -> float:
    """κ that puts the optimum at p_star: p* = sqrt((1 − σ)/κ)."""
    return (1 - sigma) / (p_star * p_star)


@dataclass(frozen=True)
class Scenario:
    name: str
    endpoint: Endpoint
    noise: float = 0.05
    after: Endpoint | None = None        # the endpoint from half-way on


SCENARIOS = [
    Scenario("p*=12", Endpoint(0.02, kappa_for(12, 0.02))),
    Scenario("p*=12 noise 20%", Endpoint(0.02, kappa_for(12, 0.02)), noise=0.20),
    Scenario("p*=3 retrograde, 502 above 5", Endpoint(0.05, kappa_for(3, 0.05), fail_above=5)),
    Scenario("p*=30, 502 above 12", Endpoint(0.01, kappa_for(30, 0.01), fail_above=12)),
    Scenario("linear", Endpoint(0.0, 0.0)),
    Scenario("demand 6 < p*", Endpoint(0.02, kappa_for(20, 0.02), demand=6)),
    Scenario("contention x4", Endpoint(0.02, kappa_for(12, 0.02)),
             after=Endpoint(0.02 * 4, kappa_for(12, 0.02) * 4)),
]


def run(sc: Scenario, seed: int, intervals: int, lo: int = 1, hi: int = 64,
        start: int = 4, margin: float = 0.85) -> dict:
    rng = random.Random(seed)
    ctl = ConcurrencyController(lo, hi, start, margin)
    xs, caps, errors = [], [], 0
    half = intervals // 2
    for i in range(intervals):
        ep = sc.after if sc.after is not None and i >= half else sc.endpoint
        s = ep.served(ctl.cap, rng, sc.noise)
        xs.append(ep.true_x(ctl.cap))
        caps.append(ctl.cap)
        errors += s.errors > 0
        ctl.observe(s)
    ep = sc.after or sc.endpoint
    best_cap, best_x = ep.best(lo, hi)
    return {"share": statistics.fmean(xs[half:]) / best_x, "final": ctl.cap,
            "best": best_cap, "errors": errors, "caps": caps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--intervals", type=int, default=200)
    args = ap.parse_args()
    print(f"{'scenario':32s} {'share':>13s} {'final cap':>11s} {'best':>5s} {'err ivals':>10s}")
    for sc in SCENARIOS:
        rows = [run(sc, seed, args.intervals) for seed in range(args.seeds)]
        share = [r["share"] for r in rows]
        final = [r["final"] for r in rows]
        errs = [r["errors"] for r in rows]
        worst_final = max(final, key=lambda c: abs(c - statistics.median(final)))
        print(f"{sc.name:32s} {statistics.median(share):6.3f}/{min(share):5.3f} "
              f"{statistics.median(final):5.0f}/{worst_final:4d} {rows[0]['best']:5d} "
              f"{statistics.median(errs):5.0f}/{max(errs):3d}")


if __name__ == "__main__":
    main()

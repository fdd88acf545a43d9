"""How fast a phase of a step could run on this machine: its FLOPs at the matmul throughput
measured at the phase's own shapes, or its bytes at the measured memory bandwidth, whichever
takes longer (a roofline bound). Pure: no torch, no I/O; the numbers come from
`retrain.machine.measure` and the estimates from `retrain.control.stepcost`."""

from __future__ import annotations

from dataclasses import dataclass

from retrain.control.stepcost import StepCost


@dataclass(frozen=True)
class PhaseBound:
    name: str
    cost: StepCost
    gflops: float    # matmul GFLOP/s measured at this phase's shapes
    bw_gb_s: float   # memory bandwidth, GB/s

    @property
    def compute_s(self) -> float:
        return self.cost.flops / (self.gflops * 1e9)

    @property
    def memory_s(self) -> float:
        return self.cost.bytes_moved / (self.bw_gb_s * 1e9)

    @property
    def bound_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def limit(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"

    def fraction(self, measured_s: float) -> float:
        """Share of the bound reached: bound / measured (1.0 = as fast as the machine can)."""
        return self.bound_s / measured_s if measured_s > 0 else float("nan")


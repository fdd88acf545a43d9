"""What a run spends, row by row: each metrics row gets the tokens the backend's calls
carried since the row before (`prefill_tokens`, `sampled_tokens`, `trained_tokens`), the
judge's tokens (`judge_input_tokens`, `judge_output_tokens`: the training rollout's come
with the scorer's reward metrics, the held-out eval's are added here) and the wall seconds
since the row before (`wall_s`; `device_s`, x the run's ranks `world_size`, for
device-hours). Whatever the run spent between two rows
(start-up, the initial eval, checkpoints) goes in the later row. The run's total is the sum
of its rows (retrain.bill.tally), so a resumed run's budget counts what it already spent.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from retrain.bill.prices import crossed
from retrain.bill.tally import JUDGE_TOKENS, Tally
from retrain.config.cost_section import CostConfig, prices, training_budget
from retrain.config.sections import TrainingConfig
from retrain.runfiles import runlog


class Spend:
    """The run's spend since its last row, and its total (`crossed`: its budget reached)."""

    def __init__(self, run_dir: Path, backend: Any, cost: CostConfig, training: TrainingConfig,
                 heldout: Any = None):
        self.run_dir, self.usage, self.heldout = run_dir, backend.token_usage, heldout
        self.world_size = getattr(backend, "world_size", 1)  # ranks (retrain/distributed)
        self.prices, self.budget = prices(cost), training_budget(training)
        self._seen = self.usage.snapshot()
        self._since = time.perf_counter()
        self.total: Tally | None = None  # read from the rows kept, when first needed

    def into(self, row: dict) -> None:
        """Put the spend since the last row on `row` (before it is written)."""
        total = self._total()
        now, clock = self.usage.snapshot(), time.perf_counter()
        prefill, sampled, trained = (a - b for a, b in zip(now, self._seen, strict=True))
        unbilled = self.heldout.take_spent() if self.heldout is not None else {}
        judge = [int(row.get(k) or 0) + int(unbilled.get(k, 0)) for k in JUDGE_TOKENS]
        wall = clock - self._since
        spent = Tally(prefill=prefill, sampled=sampled, trained=trained, judge_input=judge[0],
                      judge_output=judge[1], wall_s=wall, device_s=wall * self.world_size)
        row.update(spent.row(), world_size=self.world_size)
        self.total = total + spent
        self._seen, self._since = now, clock

    def crossed(self) -> str | None:
        """Why the run must stop for its [training] budget (None: go on)."""
        if not self.budget.any:
            return None
        return crossed(self._total(), self.prices, self.budget)

    def _total(self) -> Tally:
        """The run's total so far: its rows kept (a resumed run's included), then ours."""
        if self.total is None:
            self.total = Tally.of_rows(runlog.read_metrics(
                self.run_dir / runlog.METRICS_FILE).rows)
        return self.total

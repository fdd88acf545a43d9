"""The campaign's concurrency: the runner's controller driven over a simulated endpoint writes
concurrency.jsonl and its state; `plot_concurrency` draws them into a PNG."""

from __future__ import annotations

import json
import random

import pytest

from bench.concurrency.sim import Endpoint, kappa_for
from retrain.campaign.concurrency import (
    INTERVAL_S,
    LOG_FILE,
    STATE_FILE,
    CampaignConcurrency,
    read_decisions,
)
from retrain.config.sections import BackendConfig
from retrain.errors import UserError
from retrain.slots.semaphore import Usage
from tests.cli.test_plot import is_png


class SimulatedEndpoint:
    """A CapOwner whose usage grows as an endpoint with a USL curve would serve it."""

    def __init__(self, endpoint: Endpoint, seed: int = 0):
        self.endpoint, self.rng = endpoint, random.Random(seed)
        self.cap, self.total = 0, Usage()

    def apply(self, cap: int) -> None:
        self.cap = cap

    def usage(self) -> Usage:
        return self.total

    def serve(self, dt: float) -> None:
        s = self.endpoint.served(self.cap, self.rng, 0.05)
        self.total = self.total + Usage(calls=int(s.throughput * dt), held_s=s.in_flight * dt,
                                        completions=int(s.throughput * dt * 8),
                                        tokens=int(s.throughput * dt * 80), errors=s.errors)


def drive(folder, endpoint: Endpoint, intervals: int) -> CampaignConcurrency:
    owner = SimulatedEndpoint(endpoint)
    cc = CampaignConcurrency(folder, BackendConfig(max_concurrent="auto"), 0.85, owner)
    cc.start()
    now = 0.0
    for _ in range(intervals):
        cc.tick(now)
        owner.serve(INTERVAL_S)
        now += INTERVAL_S
    return cc


def test_runner_controller_logs_every_decision_and_resumes(tmp_path):
    ep = Endpoint(0.02, kappa_for(12, 0.02), fail_above=14)
    cc = drive(tmp_path, ep, 60)
    rows = read_decisions(tmp_path)
    assert len(rows) == 59 and 8 <= cc.cap <= 14
    assert {"time", "cap", "in_flight", "throughput", "sigma", "kappa", "p_star",
            "reason"} <= set(rows[0])
    assert json.loads((tmp_path / STATE_FILE).read_text())["cap"] == cc.cap
    again = CampaignConcurrency(tmp_path, BackendConfig(max_concurrent="auto"), 0.85,
                                SimulatedEndpoint(ep))
    assert again.cap == cc.cap and "continuing from the learned cap" in again.resumed
    (tmp_path / STATE_FILE).write_text("{broken")
    fresh = CampaignConcurrency(tmp_path, BackendConfig(max_concurrent="auto"), 0.85,
                                SimulatedEndpoint(ep))
    assert fresh.cap == 4 and "ignored" in fresh.resumed


def test_plot_concurrency_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from retrain.cli.plot_concurrency import plot_concurrency

    drive(tmp_path, Endpoint(0.05, kappa_for(3, 0.05), fail_above=5), 40)
    out = plot_concurrency(tmp_path)
    assert out == tmp_path / "concurrency.png" and is_png(out)
    other = plot_concurrency(tmp_path, tmp_path / "pics" / "c.png")
    assert is_png(other)


def test_plot_concurrency_clear_error_without_decisions(tmp_path):
    pytest.importorskip("matplotlib")
    from retrain.cli.plot_concurrency import plot_concurrency

    with pytest.raises(UserError, match=LOG_FILE):
        plot_concurrency(tmp_path)

"""A run of N ranks ([distributed] nproc_per_node) counts N against [campaign] max_workers:
the accounting, the refusal of a run that could never start, and the runner with the fake
worker of test_runner (a 2-rank run never runs beside another when max_workers = 2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from retrain.campaign import executor as ex
from retrain.campaign.plan import CampaignPlan
from retrain.campaign.runner import run_campaign
from retrain.campaign.seats import capacity, check_ranks, fits, run_ranks
from retrain.config.loader import load, loads
from retrain.config.sections import ConfigError
from tests.campaign.test_runner import FAKE_WORKER

REPO = Path(__file__).resolve().parents[2]

CAMPAIGN = """
[training]
max_steps = 3
[backend.options]
step_s = 0.15
[logging]
log_dir = "{log_dir}"
[campaign]
seeds = [1, 2]
parallel = true
max_workers = {max_workers}
stagger_seconds = 0.0
[[campaign.conditions]]
name = "one"
[[campaign.conditions]]
name = "two"
"distributed.nproc_per_node" = 2
"""


def test_fits_counts_ranks_and_a_run_alone_always_starts():
    assert fits(2, [], 2) and fits(1, [1], 2) and not fits(2, [1], 2) and not fits(1, [2], 2)
    assert fits(3, [], 1)  # one at a time (parallel = false): a run starts alone
    assert fits(2, [2, 1], 5) and not fits(2, [2, 2], 5)


def test_capacity_is_max_workers_in_ranks():
    assert capacity(CampaignPlan(parallel=True, max_workers=2), [2, 1, 1]) == 2
    assert capacity(CampaignPlan(parallel=True, max_workers=0), [2, 1, 1]) == 4  # all at once
    assert capacity(CampaignPlan(parallel=False, max_workers=8), [2, 1]) == 1


def test_run_ranks_resolves_auto_on_a_cpu_to_one():
    cfg, _ = loads('[model]\ndevice = "cpu"\n[distributed]\nnproc_per_node = "auto"\n')
    assert run_ranks(cfg) == 1
    cfg, _ = loads("[distributed]\nnproc_per_node = 3\n")
    assert run_ranks(cfg) == 3


def test_a_run_with_more_ranks_than_max_workers_is_refused_before_anything_is_made(tmp_path):
    path = tmp_path / "exp.toml"
    path.write_text(CAMPAIGN.format(log_dir=tmp_path / "logs", max_workers=1))
    with pytest.raises(ConfigError) as err:
        run_campaign(*load(path), path, executor=ex.LocalExecutor(["false"]))
    assert str(err.value) == (
        f"{path.resolve()}: distributed.nproc_per_node: (2) of run two_s1 is more than "
        "campaign.max_workers (1): each rank counts as a worker, so it could never start; "
        "raise max_workers to 2 or lower nproc_per_node")
    assert not (tmp_path / "logs").exists()
    two, _ = loads("[distributed]\nnproc_per_node = 2\n")
    check_ranks(CampaignPlan(parallel=False, max_workers=1), {"r": two}, "x")  # one at a time
    check_ranks(CampaignPlan(parallel=True, max_workers=0), {"r": two}, "x")  # 0 = all
    with pytest.raises(ConfigError, match="campaign.max_workers"):
        check_ranks(CampaignPlan(parallel=True, max_workers=1), {"r": two}, "x")


def test_auto_ranks_on_ray_need_a_number_unless_on_a_cpu():
    cfg, plan = loads('[distributed]\nnproc_per_node = "auto"\n[campaign]\nseeds = [1]\n'
                      'executor = "ray"\n')
    with pytest.raises(ConfigError, match="Ray reserves a run's GPUs"):
        check_ranks(plan, {"r": cfg}, "x.toml")
    cfg.model.device = "cpu"
    check_ranks(plan, {"r": cfg}, "x.toml")


def _text(tmp: Path, text: str, max_workers: int) -> Path:
    path = tmp / "exp.toml"
    path.write_text(text.format(log_dir=tmp / "logs", max_workers=max_workers))
    return path


def test_the_runner_holds_at_most_max_workers_ranks(tmp_path, monkeypatch):
    """max_workers = 2: the 1-rank runs go two at a time, a 2-rank run alone; every Job
    carries its run's ranks."""
    fake = tmp_path / "fake_worker.py"
    fake.write_text(FAKE_WORKER)
    monkeypatch.setenv("FAKE_EVENTS", str(tmp_path / "events.jsonl"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    jobs: list[ex.Job] = []

    class Recording(ex.LocalExecutor):
        def launch(self, job: ex.Job) -> ex.Worker:
            jobs.append(job)
            return super().launch(job)

    path = _text(tmp_path, CAMPAIGN, 2)
    assert run_campaign(*load(path), path, executor=Recording([sys.executable, str(fake)])) == 0
    assert {j.name: j.ranks for j in jobs} == {"one_s1": 1, "one_s2": 1, "two_s1": 2,
                                               "two_s2": 2}
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    ranks = {j.name: j.ranks for j in jobs}
    held = peak = 0
    for e in sorted(events, key=lambda e: e["t"]):
        held += ranks[e["run"]] if e["tag"] == "start" else -ranks[e["run"]]
        peak = max(peak, held)
    assert peak == 2
    one = [e for e in events if e["run"].startswith("one")]
    assert sorted(e["tag"] for e in one) == ["end", "end", "start", "start"]
    starts = sorted((e["t"], e["run"]) for e in events if e["tag"] == "start")
    assert starts[0][1].startswith("one") and starts[1][1].startswith("one")  # side by side

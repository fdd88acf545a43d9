"""retrain/backends/local/threads.py: automatic CPU threads fitted to the cores other processes
leave free, at load and after every optimizer step."""

from __future__ import annotations

import pytest
import torch

from retrain.backends.local.threads import CpuThreads, fitted_at_load
from retrain.machine.cpu_share import CpuSample


class Script:
    """CPU samples as if other processes used `others` cores over each second in turn."""

    def __init__(self, others: list[float]):
        self.others = others
        self.now = CpuSample(wall_s=0.0, busy_s=0.0, own_s=0.0)

    def first(self) -> CpuSample:
        return self.now

    def __call__(self) -> CpuSample:
        use = self.others.pop(0)
        ours = 1.0  # this process kept one core busy too
        self.now = CpuSample(self.now.wall_s + 1.0, self.now.busy_s + use + ours,
                             self.now.own_s + ours)
        return self.now


def test_threads_follow_what_others_use_and_the_row_says_so() -> None:
    kept = torch.get_num_threads()
    try:
        script = Script([1.0, 1.0, 0.0, 0.3])
        auto = CpuThreads(cores=2, most=2, since=script.first(), sample=script)
        assert auto.check() == 1 and torch.get_num_threads() == 1   # a busy process came
        assert auto.metrics() == {"cpu_threads": 1.0, "others_busy_cores": pytest.approx(1.0)}
        assert auto.check() is None and torch.get_num_threads() == 1  # still there
        assert auto.check() == 2 and torch.get_num_threads() == 2      # gone: both cores again
        assert auto.check() is None and auto.metrics()["others_busy_cores"] == pytest.approx(0.3)
    finally:
        torch.set_num_threads(kept)


def test_a_check_within_a_second_of_the_last_waits_for_a_longer_window() -> None:
    start = CpuSample(wall_s=0.0, busy_s=0.0, own_s=0.0)
    samples = [CpuSample(0.5, 1.0, 0.0), CpuSample(1.5, 1.5, 0.0)]
    auto = CpuThreads(cores=2, most=2, since=start, sample=lambda: samples.pop(0))
    assert auto.check() is None and auto.last == start    # 0.5 s: mostly jiffy rounding
    kept = torch.get_num_threads()
    try:
        assert auto.check() == 1 and auto.others == pytest.approx(1.0)  # 1.5 s, from the start
    finally:
        torch.set_num_threads(kept)


def test_no_change_where_the_os_gives_no_sample() -> None:
    auto = CpuThreads(cores=2, most=2, since=None, sample=lambda: None)
    assert auto.check() is None and auto.threads == 2


def test_only_automatic_threads_on_a_cpu_are_fitted() -> None:
    assert fitted_at_load(3, "cpu", None) is None      # the user's count stands
    assert fitted_at_load(0, "cuda", None) is None     # a GPU run's threads only feed it
    kept = torch.get_num_threads()
    try:
        assert fitted_at_load(0, "cpu", None) is not None
    finally:
        torch.set_num_threads(kept)


def test_a_run_with_automatic_threads_records_them_every_step(tmp_path) -> None:
    """The real trainer on the tiny model with `threads = 0`: every step's row says the threads
    it left for the next step and what other processes used (whatever they are here)."""
    from retrain.machine.cpu import available_cores
    from retrain.machine.cpu_share import cpu_sample
    from tests.run_helpers import rows, run_in_process, write_config

    if cpu_sample() is None:
        return
    kept = torch.get_num_threads()
    try:
        path = write_config(tmp_path, model={"threads": 0}, training={"max_steps": 2})
        done = run_in_process([path.name], tmp_path)
    finally:
        torch.set_num_threads(kept)
    assert done.returncode == 0, done.stderr[-2000:]
    got = rows(tmp_path / "logs" / "run")
    assert [r["step"] for r in got] == [1, 2]
    for row in got:
        assert 1 <= row["cpu_threads"] <= available_cores()
        assert row["others_busy_cores"] >= 0.0


def test_a_step_without_an_update_records_the_threads_too(tmp_path) -> None:
    """A reward equal for every completion leaves every group without signal, so no step
    calls optim_step (which reports the threads): the rows carry them all the same."""
    from retrain.machine.cpu import available_cores
    from retrain.machine.cpu_share import cpu_sample
    from tests.run_helpers import rows, run_in_process, write_config

    if cpu_sample() is None:
        return
    kept = torch.get_num_threads()
    try:
        path = write_config(tmp_path, model={"threads": 0}, data={"eval_size": 0},
                            reward={"function": "digits.py:constant"},
                            training={"max_steps": 2})
        done = run_in_process([path.name], tmp_path)
    finally:
        torch.set_num_threads(kept)
    assert done.returncode == 0, done.stderr[-2000:]
    got = rows(tmp_path / "logs" / "run")
    assert [(r["step"], r["updates"]) for r in got] == [(1, 0), (2, 0)]
    for row in got:
        assert 1 <= row["cpu_threads"] <= available_cores()
        assert row["others_busy_cores"] >= 0.0

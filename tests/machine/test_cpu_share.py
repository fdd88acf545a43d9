"""retrain/machine/cpu_share.py: what other processes use of the CPU, and the threads that
leaves a run."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from retrain.machine.cpu_share import (
    TAKEN_CORE,
    CpuSample,
    busy_seconds,
    cpu_sample,
    others_busy_cores,
    threads_left,
)


def test_busy_seconds_leave_out_idle_iowait_and_guest_time() -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    line = "cpu  100 20 30 400 50 6 7 8 9 10"
    assert busy_seconds(line, 100) == (100 + 20 + 30 + 6 + 7 + 8) / 100
    assert busy_seconds("cpu  100 0 0 400", 100) == 1.0  # old kernels: four fields


def test_others_are_what_the_machine_used_beyond_this_process() -> None:
    before = CpuSample(wall_s=10.0, busy_s=100.0, own_s=5.0)
    after = CpuSample(wall_s=12.0, busy_s=103.5, own_s=6.5)  # 3.5 CPU-s in 2 s, 1.5 of ours
    assert others_busy_cores(before, after) == 1.0
    assert others_busy_cores(after, after) == 0.0
    # jiffy rounding can make ours exceed the machine's by a tick: never negative
    assert others_busy_cores(before, CpuSample(11.0, 100.0, 5.02)) == 0.0


def test_a_sample_of_this_machine_and_none_where_there_is_no_proc_stat(tmp_path) -> None:
    sample = cpu_sample()
    if sys.platform.startswith("linux"):
        assert sample is not None and sample.busy_s > 0 and sample.own_s > 0
    assert cpu_sample(str(tmp_path / "absent")) is None
    (tmp_path / "stat").write_text("intr 1 2 3\n")
    assert cpu_sample(str(tmp_path / "stat")) is None


def test_a_busy_child_counts_as_others_and_this_process_does_not() -> None:
    """A child that burns 0.5 CPU-s shows as at least most of that in others' use, whatever
    else runs (other processes only add to it); this process's own burn is left out."""
    if cpu_sample() is None:
        return
    before = cpu_sample()
    burn = ("import time\nt = time.process_time()\n"
            "while time.process_time() - t < 0.5: pass\n")
    subprocess.run([sys.executable, "-c", burn], check=True)
    after = cpu_sample()
    others_cpu_s = others_busy_cores(before, after) * (after.wall_s - before.wall_s)
    assert others_cpu_s >= 0.4, others_cpu_s


@given(cores=st.integers(1, 256), others=st.floats(0, 300), most=st.integers(1, 256))
def test_threads_stay_between_one_and_the_automatic_count(cores, others, most) -> None:
    assert 1 <= threads_left(cores, others, most) <= most


@given(cores=st.integers(1, 64), a=st.floats(0, 80), b=st.floats(0, 80),
       most=st.integers(1, 64))
def test_more_use_by_others_never_gives_more_threads(cores, a, b, most) -> None:
    low, high = sorted((a, b))
    assert threads_left(cores, high, most) <= threads_left(cores, low, most)


def test_a_core_counts_as_taken_from_its_threshold() -> None:
    assert threads_left(2, 0.0, 2) == 2
    assert threads_left(2, TAKEN_CORE - 0.01, 2) == 2  # a scorer's bursts take no core
    assert threads_left(2, TAKEN_CORE, 2) == 1          # one busy process: one thread
    assert threads_left(2, 1.9, 2) == 1                 # never fewer than one
    assert threads_left(8, 2.7, 8) == 5
    assert threads_left(8, 0.0, 4) == 4                 # a campaign worker's share stays the most

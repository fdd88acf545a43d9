"""The machine bound: measured matmul and bandwidth, the per-machine cache, phase bounds."""

from __future__ import annotations

import json
import math

import pytest

from retrain.control.bound import PhaseBound
from retrain.control.stepcost import StepCost
from retrain.machine.peaks import MachinePeaks, load_peaks, machine_key, save_peaks


def test_phase_bound_is_the_slower_of_compute_and_memory():
    compute = PhaseBound("decode", StepCost(flops=10e9, bytes_moved=1e9), gflops=5.0,
                         bw_gb_s=10.0)
    assert compute.compute_s == 2.0 and compute.memory_s == 0.1
    assert compute.bound_s == 2.0 and compute.limit == "compute"
    assert compute.fraction(4.0) == 0.5
    memory = PhaseBound("decode", StepCost(flops=1e9, bytes_moved=50e9), 5.0, 10.0)
    assert memory.bound_s == 5.0 and memory.limit == "memory"
    assert math.isnan(memory.fraction(0.0))


def test_peaks_cache_round_trips_per_dtype_and_threads(tmp_path):
    path = tmp_path / "machine.json"
    assert load_peaks("float32", 2, path) is None
    peaks = MachinePeaks(gflops=100.0, bw_gb_s=20.0, dtype="float32", threads=2,
                         measured="2026-11-25")
    save_peaks(peaks, path)
    save_peaks(MachinePeaks(50.0, 20.0, "bfloat16", 2, "2026-11-25"), path)
    assert load_peaks("float32", 2, path) == peaks
    assert load_peaks("bfloat16", 2, path).gflops == 50.0
    assert load_peaks("float32", 1, path) is None  # other thread count: not this measurement
    assert set(json.loads(path.read_text())) == {machine_key("float32", 2),
                                                 machine_key("bfloat16", 2)}


@pytest.mark.parametrize("text", ["", "{not json", "[1, 2]", '{"x": 1}'])
def test_a_damaged_cache_reads_as_not_measured_and_is_rewritten(tmp_path, text):
    path = tmp_path / "machine.json"
    path.write_text(text)
    assert load_peaks("float32", 2, path) is None
    peaks = MachinePeaks(1.0, 1.0, "float32", 2, "2026-11-25")
    save_peaks(peaks, path)
    assert load_peaks("float32", 2, path) == peaks


def test_measurements_are_positive_and_count_flops():
    torch = pytest.importorskip("torch")
    from retrain.machine.measure import Gemm, bandwidth_gb_s, gemm_gflops

    assert Gemm(4, 8, 16, count=3).flops == 2 * 4 * 8 * 16 * 3
    assert 0 < gemm_gflops([Gemm(8, 64, 64, 2)], torch.float32, repeat=1) < 1e6
    assert 0 < bandwidth_gb_s(megabytes=4, repeat=1) < 1e5


def test_local_cost_model_splits_body_and_lm_head(tiny_model):
    pytest.importorskip("torch")
    from retrain.backends.local.model import LocalModel

    model = LocalModel.load(tiny_model, "float32", "cpu", 1)
    cost = model.cost_model()
    embed = model.base.get_input_embeddings().weight
    head = model.base.get_output_embeddings().weight
    tied = embed.data_ptr() == head.data_ptr()
    assert cost.head_parameters == head.numel()
    assert cost.body_parameters == cost.parameters - embed.numel() - (0 if tied else head.numel())


def test_explain_offers_the_measured_peaks_for_backpressure_on_a_cpu(tmp_path, monkeypatch):
    from retrain.cli.explain import dry_run as explain

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RETRAIN_CACHE", str(tmp_path / "cache"))
    plan = tmp_path / "bp.toml"
    plan.write_text('[model]\ndevice = "cpu"\ndtype = "float32"\nthreads = 2\n'
                    "[backpressure]\nenabled = true\n")
    text = " ".join(explain.build_report(plan).warnings)
    assert "python -m retrain.machine --dtype float32 --threads 2" in text
    save_peaks(MachinePeaks(123.4, 21.6, "float32", 2, "2026-11-25"))
    text = " ".join(explain.build_report(plan).warnings)
    assert "set peak_gflops = 123 and peak_bw_gb_s = 22" in text
    plan.write_text(plan.read_text() + "peak_gflops = 100.0\npeak_bw_gb_s = 20.0\n")
    assert "peak_gflops" not in " ".join(explain.build_report(plan).warnings)


def test_python_m_retrain_machine_measures_and_caches(tmp_path, cli_env, python):
    import subprocess

    env = {**cli_env, "RETRAIN_CACHE": str(tmp_path)}
    out = subprocess.run([python, "-m", "retrain.machine", "--threads", "1"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "peak_gflops = " in out.stdout
    assert load_peaks("float32", 1, tmp_path / "machine.json").gflops > 0

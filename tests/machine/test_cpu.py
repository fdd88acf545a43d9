"""cpu.auto_threads and the campaign runner's per-worker share of the cores."""

from __future__ import annotations

from retrain.campaign.seats import thread_share_env
from retrain.config.sections import Config, run_config
from retrain.machine.cpu import (
    AUTO_THREADS_ENV,
    auto_threads,
    available_cores,
    cpu_flags,
    cpu_has_native_bf16,
)


def test_auto_threads_uses_the_share_when_set(monkeypatch) -> None:
    monkeypatch.delenv(AUTO_THREADS_ENV, raising=False)
    assert auto_threads() == available_cores() >= 1
    monkeypatch.setenv(AUTO_THREADS_ENV, "3")
    assert auto_threads() == 3
    for bad in ("0", "-2", "x", ""):
        monkeypatch.setenv(AUTO_THREADS_ENV, bad)
        assert auto_threads() == available_cores()


def test_local_workers_split_the_cores(monkeypatch) -> None:
    monkeypatch.setattr("retrain.campaign.seats.available_cores", lambda: 8)
    local = Config()
    assert thread_share_env(local, 1) == {}
    assert thread_share_env(local, 2) == {AUTO_THREADS_ENV: "4"}
    assert thread_share_env(local, 3) == {AUTO_THREADS_ENV: "2"}
    assert thread_share_env(local, 16) == {AUTO_THREADS_ENV: "1"}
    remote = run_config(Config(), **{"backend.backend": "tinker"})
    assert thread_share_env(remote, 4) == {}  # remote workers barely use the CPU


X86_AVX2 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n"
X86_BF16 = "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_cpu_flags_and_native_bf16_from_cpuinfo() -> None:
    assert "avx2" in cpu_flags(X86_AVX2) and "avx512_bf16" not in cpu_flags(X86_AVX2)
    assert not cpu_has_native_bf16(cpu_flags(X86_AVX2))
    assert cpu_has_native_bf16(cpu_flags(X86_BF16), {})
    assert cpu_has_native_bf16(cpu_flags(ARM_BF16), {})
    assert cpu_flags("") == frozenset() and not cpu_has_native_bf16(frozenset())
    assert isinstance(cpu_has_native_bf16(), bool)  # this machine's answer, whatever it is


def test_kernels_capped_below_avx512_leave_bf16_emulated() -> None:
    """ATEN_CPU_CAPABILITY=avx2 on a CPU with AVX512-BF16: torch's bf16 kernels are off, so
    `auto` must pick float32 (bf16 there crashed in SDPA's packing and is slow anyway)."""
    bf16 = cpu_flags(X86_BF16)
    assert not cpu_has_native_bf16(bf16, {"ATEN_CPU_CAPABILITY": "avx2"})
    assert not cpu_has_native_bf16(bf16, {"ATEN_CPU_CAPABILITY": "default"})
    assert cpu_has_native_bf16(bf16, {"ATEN_CPU_CAPABILITY": "avx512"})
    assert cpu_has_native_bf16(bf16, {})


# ---------------------------------------------------------------------------- a busy machine


def test_the_cli_leaves_openmp_waits_to_libgomp(cli_env, python) -> None:
    """No OMP_WAIT_POLICY=PASSIVE any more: it cost a quiet machine 25% (bench/RESULTS.md,
    2026-11-28), and automatic threads fitted to the free cores keep spinning waits from
    burning a busy machine's cores (backends/local/threads.py)."""
    import subprocess

    code = ("import sys, retrain.__main__, os; "
            "print(os.environ.get('OMP_WAIT_POLICY', 'unset'), 'torch' in sys.modules)")
    env = {k: v for k, v in cli_env.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    assert out == ["unset", "False"]


def test_busy_note_only_when_more_is_runnable_than_there_are_cores() -> None:
    from retrain.machine.cpu import busy_note

    assert busy_note(None, 2) == ""
    assert busy_note(2.4, 2) == ""          # a run's own two threads on two cores
    assert busy_note(3.1, 2) == "machine busy: load 3.1 on 2 cores"
    assert busy_note(0.2, 2, adding=2) == ""  # before a run: almost idle
    assert busy_note(1.0, 2, adding=2) == "machine busy: load 1.0 on 2 cores"


def test_the_step_line_says_when_the_machine_was_busy(monkeypatch) -> None:
    from retrain.run import progress

    monkeypatch.setattr(progress, "available_cores", lambda: 2)
    row = {"mean_reward": 0.5, "correct_rate": 0.5, "loss": 0.1, "batch_size": 2,
           "group_size": 4, "step_time_s": 1.0, "sample_time_s": 0.5, "reward_time_s": 0.1,
           "train_time_s": 0.4, "load_average": 1.9}
    assert "busy" not in progress.step_summary(row)
    row["load_average"] = 3.6
    assert progress.step_summary(row).endswith("machine busy: load 3.6 on 2 cores")


def test_explain_says_when_a_local_run_would_start_on_a_busy_machine(tmp_path,
                                                                     monkeypatch) -> None:
    from retrain.cli.explain import dry_run as explain
    from retrain.machine import cpu

    path = tmp_path / "q.toml"
    path.write_text('[model]\nname = "tiny-random"\nthreads = 2\n')
    monkeypatch.setattr(cpu, "available_cores", lambda: 2)
    monkeypatch.setattr(cpu, "load_average", lambda: 0.1)
    assert explain.build_report(path).machine == ""
    monkeypatch.setattr(cpu, "load_average", lambda: 1.5)
    report = explain.build_report(path)
    assert report.machine.startswith("machine busy: load 1.5 on 2 cores before this run")
    assert any(line.strip().startswith("machine") for line in explain.plain_lines(report))

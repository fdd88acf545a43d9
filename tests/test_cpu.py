"""cpu.auto_threads and the campaign runner's per-worker share of the cores."""

from __future__ import annotations

from retrain.campaign.runner import thread_share_env
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
    monkeypatch.setattr("retrain.campaign.runner.available_cores", lambda: 8)
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
    assert cpu_has_native_bf16(cpu_flags(X86_BF16))
    assert cpu_has_native_bf16(cpu_flags(ARM_BF16))
    assert cpu_flags("") == frozenset() and not cpu_has_native_bf16(frozenset())
    assert isinstance(cpu_has_native_bf16(), bool)  # this machine's answer, whatever it is

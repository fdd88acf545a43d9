"""How many CPU threads torch should use when `[model].threads = 0` (automatic)."""

from __future__ import annotations

import os

# Set by the campaign runner: each local worker's share of the cores.
AUTO_THREADS_ENV = "RETRAIN_AUTO_THREADS"


def available_cores() -> int:
    """Cores this process may run on (cgroup/affinity aware where the OS says)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def auto_threads() -> int:
    """The campaign's per-worker share when set, else every available core."""
    share = os.environ.get(AUTO_THREADS_ENV, "")
    return int(share) if share.isdigit() and int(share) > 0 else available_cores()


# CPU feature flags (Linux /proc/cpuinfo) that mean bfloat16 matmuls run in hardware. Without
# them torch emulates bfloat16: on a 2-core AVX2 EPYC, SmolLM2-135M forward was 4.4x and
# forward+backward 25.7x slower in bfloat16 than in float32 (python -m bench.dtype_speed).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def cpu_model_name(cpuinfo: str | None = None) -> str:
    """The processor's name (Linux `model name`), else platform's; for per-machine caches."""
    import platform

    for line in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return platform.processor() or platform.machine() or "unknown"


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (x86 `flags`, Arm `Features`); empty where the OS does not say."""
    if cpuinfo is None:
        cpuinfo = _cpuinfo()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_has_native_bf16(flags: frozenset[str] | None = None,
                        env: dict | None = None) -> bool:
    """True when this CPU computes bfloat16 in hardware (AVX512-BF16, AMX or Arm BF16) and
    torch may use it: ATEN_CPU_CAPABILITY capped below AVX-512 (e.g. `avx2`, to run as an
    AVX2-only machine does) leaves bf16 emulated, and its packed bf16 kernels then refuse to
    run ('pack_vnni2 is only supported when avx512 is supported')."""
    capability = (os.environ if env is None else env).get(ATEN_CAPABILITY_ENV, "").lower()
    if capability and not capability.startswith("avx512"):
        return False
    return bool(NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else flags))


ATEN_CAPABILITY_ENV = "ATEN_CPU_CAPABILITY"


def load_average() -> float | None:
    """The one-minute load average (runnable processes), where the OS says."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_note(load: float | None, cores: int, adding: int = 0) -> str:
    """'' unless more work is runnable than there are cores: then one line saying so.
    `adding`: the threads a run will add (before it starts); 0 while it runs (its own threads
    are already counted in `load`)."""
    if load is None or load + adding <= cores + 0.5:
        return ""
    return f"machine busy: load {load:.1f} on {cores} cores"

"""This machine's peaks (matmul GFLOP/s, memory GB/s), measured once per machine, thread
count, torch version and dtype and kept in `<cache>/machine.json` ($RETRAIN_CACHE, else
~/.cache/retrain): the roofline hints and `retrain explain` read them without measuring again.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from retrain.machine.cpu import cpu_model_name

CACHE_FILE = "machine.json"


@dataclass(frozen=True)
class MachinePeaks:
    gflops: float       # the canonical matmul (retrain.machine.measure.CANONICAL)
    bw_gb_s: float      # a large copy, bytes read + written
    dtype: str
    threads: int
    measured: str       # ISO date


def machine_key(dtype: str, threads: int, device: str = "cpu") -> str:
    """What the peaks depend on: the processor, the threads, torch's version and the dtype."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "?"
    return f"{device}|{cpu_model_name()}|{threads} threads|torch {torch_version}|{dtype}"


def cache_path() -> Path:
    from retrain.backends.models import cache_dir

    return cache_dir().parent / CACHE_FILE  # beside models/, under $RETRAIN_CACHE


def load_peaks(dtype: str, threads: int, path: Path | None = None) -> MachinePeaks | None:
    """The cached peaks for this machine, or None (never measured, or an unreadable cache)."""
    try:
        entry = json.loads((path or cache_path()).read_text())[machine_key(dtype, threads)]
        return MachinePeaks(**entry)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_peaks(peaks: MachinePeaks, path: Path | None = None) -> None:
    path = path or cache_path()
    try:
        table = json.loads(path.read_text())
        if not isinstance(table, dict):
            table = {}
    except (OSError, ValueError):
        table = {}
    table[machine_key(peaks.dtype, peaks.threads)] = asdict(peaks)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
    tmp.replace(path)


def measure_peaks(dtype: str = "float32", threads: int = 0) -> MachinePeaks:
    """Measure now (a few seconds) with `threads` torch threads (0: as set), and cache."""
    import torch

    from retrain.machine import measure

    if threads:
        torch.set_num_threads(threads)
    peaks = MachinePeaks(gflops=measure.peak_gflops(getattr(torch, dtype)),
                         bw_gb_s=measure.bandwidth_gb_s(), dtype=dtype,
                         threads=torch.get_num_threads(),
                         measured=datetime.date.today().isoformat())
    save_peaks(peaks)
    return peaks


"""cpu.auto_threads and the campaign runner's per-worker share of the cores."""

from __future__ import annotations

from retrain.campaign.runner import thread_share_env
from retrain.config import Config, run_config
from retrain.cpu import AUTO_THREADS_ENV, auto_threads, available_cores


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

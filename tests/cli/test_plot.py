"""`retrain plot`: a synthetic run's metrics.jsonl becomes a valid PNG; clear errors otherwise."""

from __future__ import annotations

import math
import random
import sys

import pytest

from retrain.config.sections import BackpressureConfig
from retrain.control.backpressure.controller import BackpressureController
from retrain.control.usl import usl_throughput
from retrain.errors import UserError
from retrain.runfiles.runlog import MetricsWriter
from tests import warm

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
G = 8


def fake_run(folder, steps: int = 60, enabled: bool = True):
    """A run folder whose metrics come from the real controller on a simulated machine."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(f"[backpressure]\nenabled = {str(enabled).lower()}\n"
                                        "throttle_margin = 0.8\n")
    rng = random.Random(0)
    cfg = BackpressureConfig(enabled=enabled, max_batch_size=48, throttle_margin=0.8)
    ctl = BackpressureController(cfg, G)
    b = ctl.first_batch_size(8)
    with MetricsWriter(folder / "metrics.jsonl") as out:
        for step in range(1, steps + 1):
            x = usl_throughput(b * G, 0.03, 4e-5, 500.0) * math.exp(rng.gauss(0, 0.05))
            tokens = b * G * 200
            d = ctl.observe(b, tokens, tokens / x)
            out.write({"step": step, "batch_size": b, "group_size": G,
                       "tokens_per_second": x, "step_time_s": tokens / x,
                       "sample_time_s": 0.7 * tokens / x, "train_time_s": 0.3 * tokens / x,
                       "mean_reward": min(1.0, step / steps + rng.uniform(-0.1, 0.1)),
                       "correct_rate": None if step % 7 else 0.5, **d.metrics()})
            b = d.batch_size
    return folder


def is_png(path) -> bool:
    data = path.read_bytes()
    return data[:8] == PNG_MAGIC and b"IHDR" in data[:32] and data.endswith(b"IEND\xaeB`\x82")


@pytest.fixture
def matplotlib():
    return pytest.importorskip("matplotlib")


def test_plot_writes_a_png(tmp_path, matplotlib):
    from retrain.cli.plot import plot_run

    run = fake_run(tmp_path / "run")
    out = plot_run(run)
    assert out == run / "usl.png" and is_png(out)
    other = plot_run(run, tmp_path / "pics" / "x.png")
    assert other == tmp_path / "pics" / "x.png" and is_png(other)


def test_plot_without_backpressure_and_with_torn_lines(tmp_path, matplotlib):
    from retrain.cli.plot import plot_run

    run = fake_run(tmp_path / "off", steps=5, enabled=False)
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 6, "batch_')            # a crash mid-write
    assert is_png(plot_run(run))


def test_unbounded_p_star(tmp_path, matplotlib):
    from retrain.cli.plot import plot_run

    run = tmp_path / "lin"
    run.mkdir()
    with MetricsWriter(run / "metrics.jsonl") as out:
        for step, b in enumerate([1, 2, 4, 8], 1):
            out.write({"step": step, "batch_size": b, "group_size": G,
                       "tokens_per_second": 100.0 * b * G, "bp_sigma": 0.0, "bp_kappa": 0.0,
                       "bp_lambda": 100.0, "bp_p_star": None, "bp_regime": "optimal",
                       "bp_p": b * G})
    assert is_png(plot_run(run))


def test_clear_errors(tmp_path, matplotlib):
    from retrain.cli.plot import plot_run

    with pytest.raises(UserError, match="no such run folder"):
        plot_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="metrics.jsonl: not found"):
        plot_run(tmp_path / "empty")
    (tmp_path / "empty" / "metrics.jsonl").write_text("garbage\n")
    with pytest.raises(UserError, match="no metrics rows"):
        plot_run(tmp_path / "empty")


def test_missing_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    from retrain.cli import plot

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)   # import now fails
    with pytest.raises(UserError, match=r"pip install 'retrain\[plot\]'"):
        plot.plot_run(fake_run(tmp_path / "run", steps=3))


def test_cli_plot(tmp_path, cli_env, python, matplotlib):
    run = fake_run(tmp_path / "run", steps=20)
    res = warm.run([python, "-m", "retrain", "plot", str(run)], env=cli_env,
                   capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "usl.png" in res.stdout and is_png(run / "usl.png")
    res = warm.run([python, "-m", "retrain", "plot", str(tmp_path / "nope")], env=cli_env,
                   capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "no such run folder" in res.stderr
    assert "Traceback" not in res.stderr

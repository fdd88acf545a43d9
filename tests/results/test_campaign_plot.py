"""`retrain plot logs/<campaign>`: one PNG of each condition's mean curve with its band."""

from __future__ import annotations

import struct

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("scipy")

from retrain.cli.app import run_app  # noqa: E402
from retrain.results.campaign_plot import DPI, FIGSIZE  # noqa: E402
from tests.results_helpers import write_campaign, write_run  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """(width, height) from a valid PNG's IHDR chunk (asserts the file is a whole PNG)."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", data[:16]
    assert data.endswith(b"IEND\xaeB`\x82")
    return struct.unpack(">II", data[16:24])


def _campaign(tmp_path):
    runs = {(c, s): {"rewards": [0.1 * i * (2 if c == "fast" else 1) + 0.01 * s
                                 for i in range(10)], "evals": {5: 0.1 * s, 10: 0.2 * s}}
            for c in ("fast", "slow") for s in (1, 2, 3)}
    runs[("slow", 4)] = {"rewards": [0.5], "state": "failed"}
    return write_campaign(tmp_path / "camp", runs)


def test_campaign_plot_is_a_png_of_the_expected_size(tmp_path, capsys):
    camp = _campaign(tmp_path)
    assert run_app(["plot", str(camp)]) == 0
    out = camp / "curves.png"
    assert f"wrote {out}" in capsys.readouterr().out
    assert png_size(out) == (FIGSIZE[0] * DPI, FIGSIZE[1] * DPI)
    other = tmp_path / "pics" / "c.png"
    assert run_app(["plot", str(camp), "--out", str(other)]) == 0
    assert png_size(other) == (1300, 500)


def test_a_run_folder_keeps_the_back_pressure_picture(tmp_path):
    run = write_run(tmp_path / "run", [0.1, 0.2, 0.3])
    assert run_app(["plot", str(run)]) == 0
    assert (run / "usl.png").is_file() and not (run / "curves.png").exists()


def test_a_campaign_without_steps_is_an_error(tmp_path, capsys):
    camp = write_campaign(tmp_path / "c", {("a", 1): {"rewards": []}})
    assert run_app(["plot", str(camp)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no run of this campaign has metrics" in err


def test_an_auto_cap_campaign_also_gets_its_concurrency_picture(tmp_path, capsys):
    """`retrain plot logs/<campaign>` draws the conditions' curves and, where the campaign's
    API concurrency was "auto", its USL curve with the chosen cap (concurrency.png)."""
    from bench.concurrency.sim import Endpoint, kappa_for
    from tests.cli.test_plot_concurrency import drive

    camp = _campaign(tmp_path)
    assert run_app(["plot", str(camp)]) == 0
    assert "concurrency.png" not in capsys.readouterr().out   # a fixed cap: no such picture
    drive(camp, Endpoint(0.05, kappa_for(3, 0.05), fail_above=5), 40)
    assert run_app(["plot", str(camp)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {camp / 'curves.png'}" in out and f"wrote {camp / 'concurrency.png'}" in out
    assert png_size(camp / "concurrency.png")[0] > 0

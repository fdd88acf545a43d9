"""Back-pressure's small truths in `explain` (pilots, warnings) and `status` (p*, tokens/s)."""

from __future__ import annotations

import json

from retrain.cli import status, status_view
from retrain.cli.explain import dry_run as explain
from retrain.config import loader as config_file
from retrain.config import sections as config
from tests.plans import GRPO_VS_RLOO, SINGLE_RUN

BP = SINGLE_RUN + "[backpressure]\nenabled = true\n"


def write(tmp_path, text, name="plan.toml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def make_run(folder, cfg, rows, mtime=None):
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(config_file.dumps_config(cfg))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def steps(times, **extra):
    return [{"step": i + 1, "step_time_s": t, **extra} for i, t in enumerate(times)]


def test_a_fixed_batch_plan_never_borrows_from_a_back_pressure_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, SINGLE_RUN)
    on = config_file.load_config(write(tmp_path, BP, "bp.toml"))
    make_run(tmp_path / "logs" / "bp-run", on, steps([7.0, 7.0], bp_regime="optimal",
                                                     batch_size=2))
    assert explain.build_report(path).pilot is None
    make_run(tmp_path / "logs" / "fixed", config_file.load_config(path), steps([3.0]))
    assert explain.build_report(path).pilot.median_step_time_s == 3.0


def test_a_back_pressure_plan_borrows_settled_steps_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, BP)
    fixed = config_file.load_config(write(tmp_path, SINGLE_RUN, "f.toml"))
    make_run(tmp_path / "logs" / "fixed", fixed, steps([3.0, 3.0]))
    assert explain.build_report(path).pilot is None          # another back-pressure setting
    rows = (steps([1.0, 2.0, 9.0], bp_regime="warmup", batch_size=4)
            + [{"step": 4, "step_time_s": 5.0, "bp_regime": "optimal", "batch_size": 11},
               {"step": 5, "step_time_s": 8.0, "bp_regime": "optimal", "batch_size": 6},
               {"step": 6, "step_time_s": 6.0, "bp_regime": "optimal", "batch_size": 6}])
    make_run(tmp_path / "logs" / "bp-run", config_file.load_config(path), rows)
    pilot = explain.build_report(path).pilot
    assert pilot.median_step_time_s == 7.0 and pilot.steps == 2   # batch 6, after the warm-up
    other = config.run_config(config_file.load_config(path), **{"backpressure.max_batch_size": 8})
    make_run(tmp_path / "logs" / "other-bounds", other, rows[-1:])
    assert explain.build_report(path).pilot.run.endswith("bp-run")


def test_scheduling_keys_without_runs_to_schedule_are_called_out(tmp_path):
    r = explain.build_report(write(tmp_path, SINGLE_RUN + "[campaign]\nparallel = true\n"
                                   "max_workers = 4\n"))
    assert r.kind == "single run"
    (w,) = [w for w in r.warnings if "campaign.parallel" in w]
    assert "campaign.max_workers" in w and "single run" in w and "seeds" in w
    plain = explain.build_report(write(tmp_path, SINGLE_RUN, "plain.toml"))
    assert not any("campaign." in w for w in plain.warnings)


def test_back_pressure_across_conditions_is_called_out(tmp_path):
    two = "\n[campaign]\n" + GRPO_VS_RLOO
    on = explain.build_report(write(tmp_path, BP + two))
    assert any("stop being comparable" in w for w in on.warnings)
    off = explain.build_report(write(tmp_path, SINGLE_RUN + two, "off.toml"))
    assert not any("comparable" in w for w in off.warnings)
    seeds_only = explain.build_report(write(tmp_path, BP + "[campaign]\nseeds = [1, 2]\n",
                                            "seeds.toml"))
    assert not any("comparable" in w for w in seeds_only.warnings)


def test_status_shows_p_star_and_throughput_of_back_pressure_runs(tmp_path):
    run = tmp_path / "logs" / "bp"
    run.mkdir(parents=True)
    rows = [{"step": 1, "bp_action": "hold", "bp_regime": "warmup", "bp_p_star": None,
             "bp_throughput": 100.0},
            {"step": 2, "bp_action": "increase", "bp_regime": "optimal", "bp_p_star": 221.4,
             "bp_throughput": 812.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = status.scan_run(run)
    assert got.bp_p_star == 221.4 and got.bp_throughput == 812.5
    cells = " ".join(status_view._run_cells(got))
    assert "p*=221" in cells and "812" in cells and "tok/s" in cells
    plain = tmp_path / "logs" / "plain"
    plain.mkdir()
    (plain / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    assert status.scan_run(plain).bp_p_star is None
    assert "p*" not in " ".join(status_view._run_cells(status.scan_run(plain)))

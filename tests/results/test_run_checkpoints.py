"""A run folder only ever uses its own checkpoints, whatever folder a command runs from and
wherever the run folder went (archived by --new, copied, read from another project): through
the real CLI on tiny runs. Records written before checkpoints were stored relative to the run
folder (absolute, or relative to the folder training ran from) are read by name."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")

from retrain.cli.app import run_app  # noqa: E402
from retrain.results import run_checkpoint  # noqa: E402
from tests.run_helpers import state, write_config  # noqa: E402

WEIGHTS = "adapter_model.safetensors"


@contextlib.contextmanager
def inside(folder: Path):
    """Run CLI commands from `folder`, as a user who `cd`s there."""
    before = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def train(project: Path, *args: str) -> None:
    with inside(project):
        assert run_app(["run", "q.toml", *args]) == 0


def project(root: Path, seed: int) -> Path:
    """A folder with q.toml (logs go to ./logs, relative: where `retrain q.toml` runs)."""
    root.mkdir(parents=True)
    write_config(root, "q", training={"max_steps": 2, "save_every": 1, "seed": seed},
                 data={"eval_size": 4})
    return root


def weights(checkpoint: Path) -> bytes:
    return (checkpoint / WEIGHTS).read_bytes()


def as_old_records(run_dir: Path, prefix: str) -> None:
    """Rewrite the run's checkpoint records the way retrain wrote them before: the path the
    training process used, `<prefix>/checkpoints/step-N` (prefix = its log_dir/run_name)."""
    for path in [run_dir / "state.json", *(run_dir / "checkpoints").glob("step-*.json")]:
        record = json.loads(path.read_text())
        record["checkpoint"] = f"{prefix}/checkpoints/{Path(record['checkpoint']).name}"
        path.write_text(json.dumps(record))


@pytest.fixture(scope="module")
def projects(tmp_path_factory, tiny_model) -> tuple[Path, Path]:
    """Two projects, each with its own 2-step run logs/q (different seeds: different
    weights), each trained from its own folder."""
    root = tmp_path_factory.mktemp("projects")
    a, b = project(root / "projA", seed=3), project(root / "projB", seed=5)
    train(a)
    train(b)
    step2 = "logs/q/checkpoints/step-000002"
    assert weights(a / step2) != weights(b / step2)
    return a, b


def test_records_name_checkpoints_relative_to_the_run_folder(projects):
    run = projects[0] / "logs" / "q"
    assert state(run)["checkpoint"] == "checkpoints/step-000002"
    point = json.loads((run / "checkpoints" / "step-000001.json").read_text())
    assert point["checkpoint"] == "checkpoints/step-000001"


@pytest.mark.parametrize("records", ["as written", "old, relative", "old, absolute"])
def test_a_run_folder_read_from_another_project_uses_its_own_checkpoint(
        projects, tmp_path, capsys, records):
    a, b = (shutil.copytree(p, tmp_path / p.name) for p in projects)
    if records != "as written":  # B trained from projB, so its old records say logs/q/...
        as_old_records(b / "logs" / "q", "logs/q" if records == "old, relative"
                       else str(a / "logs" / "q"))
    with inside(a):  # projA has a logs/q of its own
        assert run_app(["export", "../projB/logs/q", str(tmp_path / "out")]) == 0
    own = b / "logs/q/checkpoints/step-000002"
    assert (tmp_path / "out" / WEIGHTS).read_bytes() == weights(own)


@pytest.mark.parametrize("prefix", ["logs/q", "absolute"])
def test_an_archived_run_exports_its_own_adapter_not_the_new_runs(projects, tmp_path, prefix):
    a = shutil.copytree(projects[0], tmp_path / "projA")
    train(a, "--new", "--seed", "9")
    (archived,) = (a / "logs").glob("q.prev-*")
    if prefix == "absolute":
        as_old_records(archived, str(a / "logs" / "q"))
    else:
        as_old_records(archived, prefix)
    with inside(a):
        assert run_app(["export", str(archived.relative_to(a)), str(tmp_path / "out")]) == 0
    exported = (tmp_path / "out" / WEIGHTS).read_bytes()
    assert exported == weights(archived / "checkpoints" / "step-000002")
    assert exported != weights(a / "logs/q/checkpoints/step-000002")


def test_a_copied_run_without_its_checkpoints_is_refused(projects, tmp_path, capsys):
    copy = shutil.copytree(projects[0] / "logs" / "q", tmp_path / "elsewhere" / "q")
    shutil.rmtree(copy / "checkpoints")
    as_old_records(copy, "logs/q")  # the copy's records name projA's logs/q/... by path
    capsys.readouterr()
    with inside(projects[0]):
        assert run_app(["eval", str(copy)]) == 2
        assert run_app(["export", str(copy), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("error: ") for line in lines), err
    assert "checkpoints/step-000002 is missing" in lines[0] and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (copy / "evals").exists()


def test_a_checkpoint_outside_the_run_folder_is_refused(projects, tmp_path, capsys):
    run = shutil.copytree(projects[1] / "logs" / "q", tmp_path / "q")
    elsewhere = shutil.copytree(run / "checkpoints" / "step-000002", tmp_path / "adapter")
    for point in (run / "checkpoints").glob("*.json"):
        point.unlink()
    record = state(run)
    record["checkpoint"] = str(elsewhere)
    (run / "state.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert run_app(["export", str(run), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert f"checkpoint '{elsewhere}' is outside the run folder" in err
    assert not (tmp_path / "out").exists()


def test_resuming_another_projects_run_loads_that_runs_weights(tmp_path, tiny_model):
    """`retrain ../projB/q.toml --log-dir ../projB/logs` from projA resumes B from B's own
    checkpoint, exactly as resuming it from projB does."""
    a, b = project(tmp_path / "projA", seed=3), project(tmp_path / "projB", seed=5)
    train(a)
    train(b)
    shutil.copytree(b / "logs" / "q", b / "logs" / "qref")
    as_old_records(b / "logs" / "q", "logs/q")  # as B's own training wrote them before
    train(b, "--set", "logging.run_name=qref", "--max-steps", "3")  # the reference
    with inside(a):
        code = run_app(["run", "../projB/q.toml", "--log-dir", "../projB/logs",
                        "--max-steps", "3"])
    assert code == 0
    step3 = "checkpoints/step-000003"
    assert _tensors(b / "logs" / "q" / step3) == pytest.approx(
        _tensors(b / "logs" / "qref" / step3), abs=1e-6)


def _tensors(checkpoint: Path) -> list[float]:
    from safetensors.torch import load_file

    weights = load_file(str(checkpoint / WEIGHTS))
    return [x for k in sorted(weights) for x in weights[k].flatten().tolist()]


# ---------------------------------------------------------------------------- pruned meanwhile


@pytest.fixture
def pruned_after_pick(projects, tmp_path, monkeypatch):
    """A copy of projA's run as it stood after step 1, and a `pick` after which the run
    commits step 2 and prunes step 1 (as a run still training does, between pick and load)."""
    run = shutil.copytree(projects[0] / "logs" / "q", tmp_path / "q")
    folder = run / "checkpoints"
    aside = shutil.move(folder / "step-000002", tmp_path / "step-000002")
    aside_point = shutil.move(folder / "step-000002.json", tmp_path / "step-000002.json")
    shutil.copyfile(folder / "step-000001.json", run / "state.json")
    real_pick = run_checkpoint.pick
    picks = []

    def pick_then_prune(run_dir, step):
        ckpt = real_pick(run_dir, step)
        picks.append(ckpt.step)
        if len(picks) == 1:
            shutil.move(aside, folder / "step-000002")
            shutil.copyfile(aside_point, run / "state.json")
            shutil.move(aside_point, folder / "step-000002.json")
            shutil.rmtree(folder / "step-000001")
            (folder / "step-000001.json").unlink()
        return ckpt

    monkeypatch.setattr(run_checkpoint, "pick", pick_then_prune)
    return run, picks


def test_export_picks_again_when_the_newest_checkpoint_is_pruned_meanwhile(
        pruned_after_pick, tmp_path):
    run, picks = pruned_after_pick
    assert run_app(["export", str(run), str(tmp_path / "out")]) == 0
    assert picks == [1, 2]
    assert (tmp_path / "out" / WEIGHTS).read_bytes() == weights(run / "checkpoints/step-000002")
    assert "step 2" in (tmp_path / "out" / "README.md").read_text()


def test_a_named_step_pruned_meanwhile_is_named_not_blamed_on_the_output(
        pruned_after_pick, tmp_path, capsys):
    run, _ = pruned_after_pick
    assert run_app(["export", str(run), str(tmp_path / "out"), "--step", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --step 1: ") and "deleted that checkpoint" in err, err
    assert "cannot write the export" not in err and len(err.strip().splitlines()) == 1

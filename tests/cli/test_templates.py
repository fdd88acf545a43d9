"""`retrain init` templates: they load, keep the promised profiles, explain every line, and
ship inside the package."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from retrain.cli import templates
from retrain.config import loader as config_file
from retrain.errors import UserError

REPO = Path(__file__).resolve().parents[2]
NAMES = [name for name, _ in templates.list_templates()]


def test_the_five_templates_exist():
    assert NAMES == ["quickstart", "experiment", "campaign", "algorithms", "environment"]


@pytest.mark.parametrize("name", NAMES)
def test_every_template_loads(tmp_path, name):
    path = templates.write_template(name, tmp_path / f"{name}.toml")
    pair = config_file.load(path)
    assert config_file.loads(config_file.dumps_config(*pair)) == pair


def test_quickstart_is_the_tuned_profile_on_built_ins(tmp_path):
    cfg, plan = config_file.load(templates.write_template("quickstart", tmp_path / "q.toml"))
    assert plan is None
    assert cfg.model.name == "smollm2-135m-instruct"
    assert cfg.data.source == "arithmetic" and cfg.backend.backend == "local"
    t = cfg.training
    # Tuned so SmolLM2 learns within minutes on 2 CPU cores (README: measured gain).
    assert (t.batch_size, t.group_size, t.max_tokens, t.max_steps) == (4, 8, 48, 20)
    assert cfg.data.eval_size > 0 and "boxed" in cfg.data.instruction


def test_smoke_profile_example_keeps_the_documented_shape():
    cfg = config_file.load_config(Path(__file__).parents[2] / "configs" / "arithmetic.toml")
    t = cfg.training
    assert (t.batch_size, t.group_size, t.max_tokens) == (2, 8, 1024)


def test_experiment_is_the_standard_profile(tmp_path):
    cfg, plan = config_file.load(templates.write_template("experiment", tmp_path / "e.toml"))
    t = cfg.training
    assert plan is None
    assert (t.batch_size, t.group_size, t.max_tokens) == (8, 16, 10240)


def test_campaign_has_conditions_seeds_workers_and_backpressure(tmp_path):
    path = templates.write_template("campaign", tmp_path / "c.toml")
    _, plan = config_file.load(path)
    assert plan is not None and plan.is_campaign and plan.parallel and plan.max_workers >= 2
    assert len(plan.conditions) >= 2 and len(plan.seeds) >= 2
    raw = tomllib.loads(path.read_text())
    assert set(raw["backpressure"]) >= {"enabled", "warmup_steps", "min_batch_size",
                                        "max_batch_size"}


@pytest.mark.parametrize("name", NAMES)
def test_every_key_line_has_a_comment_above_it(name):
    lines = templates.template_text(name).splitlines()
    assert lines[0].startswith("#")
    for i, line in enumerate(lines):
        if line.strip() and not line.startswith(("#", "[")):
            assert lines[i - 1].startswith("#"), f"{name}.toml line {i + 1} has no comment: {line}"


def test_write_refuses_to_overwrite_without_force(tmp_path):
    path = templates.write_template("quickstart", tmp_path / "q.toml")
    path.write_text("# my edits\n")
    with pytest.raises(UserError, match="already exists.*--force"):
        templates.write_template("quickstart", path)
    assert path.read_text() == "# my edits\n"
    templates.write_template("quickstart", path, force=True)
    assert "smollm2" in path.read_text()


def test_default_path_and_folder_target(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert templates.write_template("campaign") == Path("campaign.toml")
    assert (tmp_path / "campaign.toml").is_file()
    (tmp_path / "cfg").mkdir()
    assert templates.write_template("experiment", tmp_path / "cfg") == \
        tmp_path / "cfg" / "experiment.toml"
    assert templates.write_template("quickstart", tmp_path / "new" / "dir" / "q.toml").is_file()


def test_unknown_template_suggests_a_name():
    with pytest.raises(UserError, match="did you mean 'quickstart'"):
        templates.template_text("quikstart")


def test_unwritable_target_is_a_user_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError, match="cannot write"):
        templates.write_template("quickstart", blocker / "q.toml")


def test_templates_ship_inside_the_package():
    # retrain/cli/_templates is the package-data view of the top-level templates/ folder.
    packaged = REPO / "retrain" / "cli" / "_templates"
    assert packaged.resolve() == (REPO / "templates").resolve()
    for name in NAMES:
        assert (packaged / f"{name}.toml").read_text() == templates.template_text(name)
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]["retrain.cli"]
    assert "_templates/*.toml" in data and "_templates/*.py" in data
    for name, files in templates.COMPANIONS.items():
        assert name in NAMES and all((packaged / f).is_file() for f in files)



def test_the_environment_template_writes_its_environment_and_trains(tmp_path, monkeypatch,
                                                                    tiny_model):
    pytest.importorskip("torch")
    from retrain.environments.kinds import KindContext, build_factory
    from retrain.run.single import run_single

    path = templates.write_template("environment", tmp_path / "environment.toml")
    assert (tmp_path / "my_env.py").read_text() == \
        (REPO / "templates" / "my_env.py").read_text()
    cfg = config_file.load_config(path)
    env = build_factory(cfg.environment, KindContext("train", tmp_path, 0))()
    opening = env.reset(5)[0]["content"]
    start = int(opening.split("from ")[1].split()[0])
    total = 0.0
    for n in range(start - 1, -1, -1):
        step = env.step(f"{n}.")
        total += step.reward
    assert step.done and total == pytest.approx(1.0)
    monkeypatch.chdir(tmp_path)  # runs as written, on the tiny model for speed
    small = config_file.load_config(path, {"model.name": "tiny-random", "training.max_steps": 1,
                                           "data.eval_size": 1, "training.max_tokens": 4})
    assert run_single(small, path) == 0
    with pytest.raises(UserError, match="my_env.py already exists"):
        (tmp_path / "environment.toml").unlink()
        templates.write_template("environment", tmp_path / "environment.toml")

"""config_paths.anchor_paths: file references survive being re-run from the log folder."""

from __future__ import annotations

from pathlib import Path

from retrain.config.paths import anchor_paths
from retrain.config.sections import Config, run_config


def test_relative_paths_become_absolute(tmp_path: Path) -> None:
    (tmp_path / "rewards.py").write_text("def f(c, a):\n    return 1.0\n")
    (tmp_path / "mymodel").mkdir()
    cfg = run_config(Config(), **{"data.source": "jsonl", "data.path": "data/x.jsonl",
                                  "reward.type": "custom", "reward.function": "rewards:f",
                                  "model.name": "mymodel"})
    out = anchor_paths(cfg, tmp_path)
    assert out.data.path == str(tmp_path / "data/x.jsonl")
    assert out.reward.function == f"{tmp_path / 'rewards.py'}:f"
    assert out.model.name == str(tmp_path / "mymodel")


def test_file_form_and_untouched_values(tmp_path: Path) -> None:
    cfg = run_config(Config(), **{"reward.type": "custom", "reward.function": "r/x.py:g"})
    assert anchor_paths(cfg, tmp_path).reward.function == f"{tmp_path / 'r/x.py'}:g"
    plain = Config()  # built-in model name, no data path, no custom reward
    assert anchor_paths(plain, tmp_path) == plain
    installed = run_config(Config(), **{"reward.type": "custom", "reward.function": "json:loads"})
    assert anchor_paths(installed, tmp_path).reward.function == "json:loads"


def test_environment_factory_and_tools_are_anchored(tmp_path: Path) -> None:
    (tmp_path / "my_env.py").write_text("class E:\n    pass\n")
    cfg = run_config(Config(), **{"environment.kind": "python",
                                  "environment.factory": "my_env:E",
                                  "environment.tools": ["calculator", "tools/t.py:search",
                                                        "json:loads"]})
    out = anchor_paths(cfg, tmp_path)
    assert out.environment.factory == f"{tmp_path / 'my_env.py'}:E"
    assert out.environment.tools == ["calculator", f"{tmp_path / 'tools/t.py'}:search",
                                     "json:loads"]

"""Every example in configs/ loads cleanly and round-trips."""

from __future__ import annotations

from pathlib import Path

import pytest

from retrain.config import loader as config_file

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


def test_there_are_examples():
    assert len(CONFIGS) >= 6


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_example_loads_and_round_trips(path):
    pair = config_file.load(path)
    assert config_file.loads(config_file.dumps_config(*pair)) == pair
    cfg = pair[0]
    if cfg.data.source == "jsonl":
        assert (path.parent / cfg.data.path).is_file()


def test_readme_lists_every_example():
    readme = (CONFIGS[0].parent / "README.md").read_text()
    for path in CONFIGS:
        assert f"`{path.name}`" in readme

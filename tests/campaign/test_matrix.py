"""The campaign matrix: counts, names, overrides, lossless per-run configs."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrain.campaign.matrix import (
    MAX_NAME,
    RunSpec,
    expand,
    matrix_hash,
    run_config_for,
    safe_name,
)
from retrain.campaign.plan import CampaignPlan, Condition
from retrain.config import toml_io
from retrain.config.loader import dumps_config, loads_config, parse, to_dict
from retrain.config.sections import Config, ConfigError
from tests.plans import GRPO_VS_RLOO

SAFE = re.compile(r"^[^\W_][\w.+=-]*$")  # letters and digits of any script (issue 28 S11)

CAMPAIGN = """
[training]
seed = 7
max_steps = 3
[backend.options]
keep = "me"
nested = { a = 1, b = 2 }
[reward.params]
weight = 0.5
[campaign]
seeds = [1, 2, 3]
""" + GRPO_VS_RLOO + """"training.lr" = 2e-5
backend.options.extra = { deep = [1, 2] }
backend.options.nested = { b = 3 }
"reward.params.weight" = 2.0
"""


def _cfg(text: str = CAMPAIGN) -> tuple[Config, CampaignPlan]:
    return parse(toml_io.loads(text))


def test_count_is_conditions_times_seeds():
    specs = expand(*_cfg())
    assert len(specs) == 6
    assert [s.name for s in specs] == ["grpo_s1", "grpo_s2", "grpo_s3",
                                       "rloo_s1", "rloo_s2", "rloo_s3"]
    assert {s.condition for s in specs} == {"grpo", "rloo"}
    assert [s.seed for s in specs] == [1, 2, 3, 1, 2, 3]


def test_grid_is_a_cartesian_product_folded_into_names():
    cfg = _cfg(CAMPAIGN + '[campaign.grid]\n"training.temperature" = [0.7, 1.0]\n'
               '"training.group_size" = [4, 8]\n')
    specs = expand(*cfg)
    assert len(specs) == 2 * 4 * 3
    names = [s.name for s in specs]
    assert len(set(names)) == len(names)
    assert "grpo_temperature-0.7_group_size-4_s1" in names
    spec = next(s for s in specs if s.name == "rloo_temperature-1.0_group_size-8_s2")
    assert spec.condition == "rloo_temperature-1.0_group_size-8"
    run = run_config_for(cfg[0], spec, "/c")
    assert (run.training.temperature, run.training.group_size, run.training.seed) == (1.0, 8, 2)
    assert run.training.lr == 2e-5


def test_grid_without_conditions_and_seeds_default_to_training_seed():
    cfg = _cfg('[training]\nseed = 11\n[campaign.grid]\n"algorithm.advantage" = ["grpo", "rloo"]\n')
    assert [s.name for s in expand(*cfg)] == ["advantage-grpo_s11", "advantage-rloo_s11"]
    only_seeds = _cfg("[campaign]\nseeds = [4, 5]\n")
    assert [s.name for s in expand(*only_seeds)] == ["base_s4", "base_s5"]


def test_unnamed_conditions_are_named_by_their_overrides():
    cfg = _cfg('[campaign]\nseeds = [1]\n[[campaign.conditions]]\n"training.lr" = 1e-4\n'
               '"algorithm.advantage" = "rloo"\n[[campaign.conditions]]\n')
    assert [s.name for s in expand(*cfg)] == ["lr-0.0001_advantage-rloo_s1", "base_s1"]


def test_every_override_applied_and_free_form_tables_merge():
    cfg, plan = _cfg()
    rloo = next(s for s in expand(cfg, plan) if s.name == "rloo_s2")
    run = run_config_for(cfg, rloo, "/abs/campaign")
    assert run.algorithm.advantage == "rloo"
    assert run.training.lr == 2e-5
    assert run.training.seed == 2
    assert run.training.max_steps == 3  # the base [training] keys are honoured
    assert run.backend.options == {"keep": "me", "nested": {"a": 1, "b": 3},
                                   "extra": {"deep": [1, 2]}}
    assert run.reward.params == {"weight": 2.0}
    assert run.logging.log_dir == "/abs/campaign"
    assert run.logging.run_name == "rloo_s2"
    assert not hasattr(run, "campaign")  # config.toml holds [campaign] at its defaults
    assert to_dict(run)["campaign"] == to_dict(Config())["campaign"]


def test_per_run_configs_round_trip_every_key():
    cfg, plan = _cfg(CAMPAIGN.replace("keep = \"me\"", 'keep = "me"\n"dotted.key" = "kept whole"'))
    for spec in expand(cfg, plan):
        run = run_config_for(cfg, spec, "/abs/campaign")
        text = dumps_config(run)
        assert loads_config(text) == run
        assert "dotted.key" in run.backend.options
        assert "kept whole" in text


@pytest.mark.parametrize("names", [
    ["../x", "x", "..", ".", "", "a/b", "a-b", "a b", "A-B"],
    ["/etc/passwd", "..\\..\\win", "~root", "-rf", "naïve/ü", "x" * 300, "x" * 301],
])
def test_adversarial_condition_names_are_safe_and_unique(names):
    plan = CampaignPlan(seeds=[1, -2], conditions=[Condition(name=n) for n in names])
    specs = expand(Config(), plan)
    run_names = [s.name for s in specs]
    assert len(specs) == 2 * len(names)
    assert len({n.lower() for n in run_names}) == len(run_names)
    for n in run_names:
        assert SAFE.match(n), n
        assert ".." not in n.split("/") and "/" not in n and "\\" not in n
        assert len(n) <= MAX_NAME


@settings(max_examples=150, deadline=None)
@given(st.lists(st.text(max_size=40), min_size=1, max_size=8, unique=True),
       st.lists(st.integers(-10**6, 10**12), min_size=1, max_size=3, unique=True))
def test_names_are_always_safe_unique_and_stable(names, seeds):
    plan = CampaignPlan(seeds=seeds, conditions=[Condition(name=n) for n in names])
    specs = expand(Config(), plan)
    again = expand(Config(), plan)
    assert specs == again
    run_names = [s.name for s in specs]
    assert len({n.lower() for n in run_names}) == len(run_names) == len(names) * len(seeds)
    assert all(SAFE.match(n) and len(n) <= MAX_NAME + 14 for n in run_names)


def test_safe_name_keeps_readable_names():
    assert safe_name("grpo-lr_1e-4.v2") == "grpo-lr_1e-4.v2"
    assert safe_name("../../x") == "x"
    assert safe_name("") == "run"
    long_a, long_b = safe_name("a" * 200), safe_name("a" * 201)
    assert long_a != long_b and len(long_a) <= MAX_NAME - 12


@pytest.mark.parametrize("key", ["training.seed", "logging.log_dir", "logging.run_name",
                                 "backend.max_concurrent", "backend.max_concurrent_min",
                                 "backend.max_concurrent_max"])
def test_reserved_keys_are_refused(key):
    value = {"training.seed": 3, "logging.log_dir": "x", "logging.run_name": "y",
             "backend.max_concurrent": 2, "backend.max_concurrent_min": 2,
             "backend.max_concurrent_max": 8}[key]
    plan = CampaignPlan(conditions=[Condition(name="c", overrides={key: value})])
    with pytest.raises(ConfigError, match=re.escape(key)):
        expand(Config(), plan)


def test_condition_and_grid_may_not_set_the_same_key():
    cfg = _cfg(CAMPAIGN + '[campaign.grid]\n"training.lr" = [1e-5]\n')
    with pytest.raises(ConfigError, match="training.lr.*one place"):
        expand(*cfg)


def _hash(pair: tuple[Config, CampaignPlan], where: str = "/a") -> str:
    cfg, plan = pair
    return matrix_hash({s.name: run_config_for(cfg, s, where) for s in expand(cfg, plan)})


def test_matrix_hash_tracks_run_configs_not_scheduling_or_location():
    cfg = _cfg()
    h = _hash(cfg)
    assert _hash(cfg, "/elsewhere") == h
    sched = _cfg(CAMPAIGN.replace("seeds = [1, 2, 3]",
                                  "seeds = [1, 2, 3]\nmax_workers = 9\nparallel = true"))
    assert _hash(sched) == h
    changed = _cfg(CAMPAIGN.replace("max_steps = 3", "max_steps = 4"))
    assert _hash(changed) != h


def test_run_spec_overrides_are_copies():
    cfg = _cfg()
    spec: RunSpec = expand(*cfg)[3]
    spec.overrides["training.lr"] = 1.0
    assert expand(*cfg)[3].overrides["training.lr"] == 2e-5

"""campaign/plan: the [campaign] table parsed on its own, and config_file splitting a file into
(run config, plan) once."""

from __future__ import annotations

import pytest

from retrain.campaign import plan as plan_mod
from retrain.campaign.plan import FILE_SECTIONS, CampaignPlan, Condition
from retrain.config import loader as config_file
from retrain.config import sections as config
from retrain.config import toml_io
from retrain.config.overrides import parse_set_args
from retrain.config.sections import Config, ConfigError

CAMPAIGN = """
[training]
max_steps = 3
[campaign]
name = "sweep"
seeds = [1, 2]
parallel = true
max_workers = 3
stagger_seconds = 0.5
[[campaign.conditions]]
name = "rloo"
"algorithm.advantage" = "rloo"
[[campaign.conditions]]
name = "lr"
training.lr = 2e-5
[campaign.grid]
"training.temperature" = [0.7, 1.0]
"""


def _problems(text: str, source: str = "c.toml") -> str:
    with pytest.raises(ConfigError) as err:
        config_file.loads(text, source)
    return str(err.value)


def test_the_file_splits_into_a_run_config_and_a_plan():
    cfg, plan = config_file.loads(CAMPAIGN)
    assert isinstance(cfg, Config) and not hasattr(cfg, "campaign")
    assert cfg.training.max_steps == 3
    assert (plan.name, plan.seeds, plan.parallel, plan.max_workers, plan.stagger_seconds) == (
        "sweep", [1, 2], True, 3, 0.5)
    assert plan.conditions == [Condition("rloo", {"algorithm.advantage": "rloo"}),
                               Condition("lr", {"training.lr": 2e-5})]
    assert plan.grid == {"training.temperature": [0.7, 1.0]}


def test_a_single_run_has_no_plan_but_read_file_keeps_an_idle_table(tmp_path):
    path = tmp_path / "one.toml"
    path.write_text("[training]\nmax_steps = 2\n[campaign]\nparallel = true\n")
    cfg, plan = config_file.load(path)
    assert plan is None and cfg.training.max_steps == 2
    _, idle = config_file.read_file(path)
    assert idle.parallel and not idle.is_campaign


@pytest.mark.parametrize("table, expands", [
    ({}, False), ({"seeds": [1]}, True), ({"grid": {"training.lr": [1e-5]}}, True),
    ({"conditions": [{"name": "a"}]}, True), ({"parallel": True, "max_workers": 8}, False),
])
def test_what_makes_a_campaign(table, expands):
    plan = config_file.parse({"campaign": table})[1]
    assert plan.is_campaign is expands


def test_campaign_sits_before_logging_in_every_file_listing():
    assert list(FILE_SECTIONS)[-2:] == ["campaign", "logging"]
    assert [s for s in FILE_SECTIONS if s != "campaign"] == list(config.SECTIONS)
    assert [s for s, *_ in config_file.describe_keys()].index("campaign") < \
        [s for s, *_ in config_file.describe_keys()].index("logging")


def test_the_run_config_alone_knows_no_campaign_section():
    with pytest.raises(ConfigError, match=r"\[campaign\]: unknown section"):
        config.from_dict({"campaign": {"seeds": [1]}})


def test_run_files_keep_a_default_campaign_table_and_load_back_as_single_runs():
    cfg, _ = config_file.loads(CAMPAIGN)
    text = config_file.dumps_config(cfg)
    raw = toml_io.loads(text)
    assert list(raw) == list(FILE_SECTIONS)
    assert raw["campaign"] == plan_mod.to_table(CampaignPlan())
    assert config_file.loads(text) == (cfg, None)
    assert config_file.loads_config(text) == cfg


def test_a_plan_round_trips_through_its_table():
    cfg, plan = config_file.loads(CAMPAIGN)
    table = plan_mod.to_table(plan)
    assert table["conditions"][1] == {"name": "lr", "training.lr": 2e-5}
    assert config_file.parse({"campaign": table})[1] == plan
    assert config_file.loads(config_file.dumps_config(cfg, plan)) == (cfg, plan)


# ---------------------------------------------------------------------------- errors

# (file content, the exact line the error must hold)
PLAN_ERRORS = [
    ("[campaign]\nseed = [1]\n",
     "c.toml: campaign.seed: unknown key (did you mean 'campaign.seeds'?); [campaign] takes "
     "name, seeds, parallel, max_workers, stagger_seconds, max_retries, conditions, grid, "
     "executor, ray_address, run_resources"),
    ("[model]\nmax_workers = 2\n",
     "did you mean 'campaign.max_workers'? 'max_workers' lives in [campaign]"),
    ("max_workers = 2\n", "c.toml: max_workers: top-level keys are not allowed; every key "
     "belongs to a section (did you mean 'campaign.max_workers'? 'max_workers' lives in "
     "[campaign])"),
    ("[campain]\n", "c.toml: [campain]: unknown section (did you mean 'campaign'?); sections are "
     "model, data, reward, environment, algorithm, training, backend, distributed, "
     "backpressure, sft, cost, campaign, logging"),
    ("[campaign]\nseeds = [2, 2]\n", "c.toml: campaign.seeds: seeds must be unique, got [2, 2]"),
    ("[campaign]\nseeds = [-1]\n", "c.toml: campaign.seeds: seeds must be >= 0, got [-1]"),
    ("[campaign]\nmax_workers = 5000\n",
     "c.toml: campaign.max_workers: must be <= 4096, got 5000"),
    ("[campaign]\nexecutor = \"rey\"\n", "c.toml: campaign.executor: \"rey\" is not allowed; "
     "use one of \"local\", \"ray\" (did you mean 'ray'?)"),
    ("[campaign]\nconditions = 3\n", "c.toml: campaign.conditions: must be an array of tables "
     "([[campaign.conditions]]), got 3"),
    ("[[campaign.conditions]]\nname = 3\n",
     "c.toml: campaign.conditions[0].name: expected a string, got 3"),
    ("[[campaign.conditions]]\n\"campaign.seeds\" = [1]\n", "c.toml: campaign.conditions[0]."
     "\"campaign.seeds\": campaign keys cannot be overridden per run"),
    ("[[campaign.conditions]]\ncampaign = { seeds = [1] }\n", "c.toml: campaign.conditions[0]."
     "\"campaign.seeds\": campaign keys cannot be overridden per run"),
    ("[[campaign.conditions]]\n\"campain.x\" = 1\n", "c.toml: campaign.conditions[0]."
     "\"campain.x\": unknown section 'campain' (did you mean 'campaign'?)"),
    ("[[campaign.conditions]]\n\"model.max_workers\" = 1\n", "unknown key 'model.max_workers' "
     "(did you mean 'campaign.max_workers'? 'max_workers' lives in [campaign])"),
    ("[[campaign.conditions]]\nname = \"a\"\n[[campaign.conditions]]\nname = \"a\"\n",
     "c.toml: campaign.conditions: condition names must be unique; repeated: a"),
    ("[campaign]\ngrid = 2\n", "c.toml: campaign.grid: must be a table, got 2"),
    ("[campaign.grid]\n\"training.lr\" = []\n", "c.toml: campaign.grid.\"training.lr\": "
     "expected a non-empty list of values, got []"),
    ("[campaign.grid]\n\"training.lr\" = [1e-5, -1]\n",
     "c.toml: campaign.grid.\"training.lr\": must be > 0, got -1"),
    ("[campaign]\nrun_resources = {tpu = 1}\n", "c.toml: campaign.run_resources.tpu: unknown "
     "resource; run_resources takes cpu and gpu, e.g. run_resources = {cpu = 2, gpu = 1}"),
    ("[campaign]\nrun_resources = {gpu = -1}\n",
     "c.toml: campaign.run_resources.gpu: expected a number >= 0, got -1"),
]


@pytest.mark.parametrize("text, expected", PLAN_ERRORS,
                         ids=[f"plan{i:02d}" for i in range(len(PLAN_ERRORS))])
def test_plan_errors_name_the_file_the_key_and_the_fix(text, expected):
    assert expected in _problems(text)


def test_run_and_plan_problems_are_reported_together_in_file_order():
    text = ("[campaign]\nseeds = [1, 1]\nmax_workers = -1\n[backpressure]\nmin_batch_size = 9\n"
            "max_batch_size = 2\n[training]\nlr = 0\n")
    assert _problems(text) == (
        "c.toml: 4 problems\n"
        "  - campaign.max_workers: must be >= 0, got -1\n"
        "  - training.lr: must be > 0, got 0\n"
        "  - backpressure.min_batch_size: (9) must be <= backpressure.max_batch_size (2)\n"
        "  - campaign.seeds: seeds must be unique, got [1, 1]")


def test_overrides_of_a_run_are_checked_against_the_run_schema():
    assert plan_mod.check_override("training.lr", 1e-5) is None
    assert plan_mod.check_override("backend.options.a.b", {"c": 1}) is None
    assert plan_mod.check_override("training.lr", "x") == 'expected a number, got "x"'
    assert plan_mod.split_key("training") == "'training' is not a 'section.key' name"
    assert plan_mod.split_key("training.lr.x") == \
        "'training.lr' is not a table, so 'training.lr.x' names nothing"


def test_command_line_sets_plain_campaign_keys_but_not_its_matrix():
    assert parse_set_args(["campaign.max_workers=4", "campaign.seeds=[1, 2]"]) == {
        "campaign.max_workers": 4, "campaign.seeds": [1, 2]}
    with pytest.raises(ConfigError, match="set campaign.grid in the TOML file"):
        parse_set_args(["campaign.grid={}"])
    with pytest.raises(ConfigError, match="did you mean 'campaign.seeds'"):
        parse_set_args(["campaign.seed=1"])


def test_run_resources_default_from_the_run():
    cfg, plan = Config(), CampaignPlan(run_resources={"gpu": 0.5})
    assert plan_mod.run_resources(cfg, plan) == {"cpu": 1.0, "gpu": 0.5}
    cfg.model.device = "cuda"
    assert plan_mod.run_resources(cfg, CampaignPlan())["gpu"] == 1.0

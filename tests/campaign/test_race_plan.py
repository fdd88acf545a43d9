"""[campaign.race]: every key checked with its bounds and a did-you-mean, and the race checked
against the campaign around it (seeds, conditions, budget, threshold) and the runs' configs."""

from __future__ import annotations

import pytest

from retrain.campaign.race_plan import RacePlan, race_of, run_issues
from retrain.config import loader
from retrain.config.sections import Config, ConfigError

CAMPAIGN = """
[campaign]
seeds = [1, 2, 3, 4, 5]
[[campaign.conditions]]
name = "a"
[[campaign.conditions]]
name = "b"
[campaign.race]
"""


def _load(race: str, campaign: str = CAMPAIGN):
    return loader.loads(campaign + race, "race.toml")


def _error(race: str, campaign: str = CAMPAIGN) -> str:
    with pytest.raises(ConfigError) as info:
        _load(race, campaign)
    return str(info.value)


def test_a_race_table_loads_into_its_plan():
    _, plan = _load('metric = "eval_accuracy"\nmin_seeds = 2\nmax_seeds = 4\nconfidence = 0.9\n'
                    'margin = 0.02\nbudget_runs = 7\nround_seeds = 2\ninterim_share = 0.5')
    race = race_of(plan.race)
    assert race == RacePlan(metric="eval_accuracy", min_seeds=2, max_seeds=4, confidence=0.9,
                            margin=0.02, budget_runs=7, round_seeds=2, interim_share=0.5)
    assert race.seeds_cap(5) == 4 and RacePlan().seeds_cap(5) == 5
    assert race_of(_load("")[1].race) == RacePlan()  # an empty table: a race at the defaults
    assert race_of(_load("", CAMPAIGN.replace("[campaign.race]", ""))[1].race) is None
    text = loader.dumps_config(Config(), plan)
    assert race_of(loader.loads(text)[1].race) == race  # the plan writes back as it was read


@pytest.mark.parametrize("race, message", [
    ('metirc = "final_reward"', "campaign.race.metirc: unknown key (did you mean 'metric'?)"),
    ('metric = "final_rewards"', "is not allowed; use one of \"final_reward\""),
    ('metric = "final_rewards"', "(did you mean 'final_reward'?)"),
    ('direction = "maximum"', "campaign.race.direction: \"maximum\" is not allowed"),
    ("min_seeds = 1", "campaign.race.min_seeds: must be >= 2, got 1"),
    ("confidence = 1.0", "campaign.race.confidence: must be <= 0.9999, got 1.0"),
    ("confidence = 0.3", "campaign.race.confidence: must be >= 0.5"),
    ("margin = -0.1", "campaign.race.margin: must be >= 0"),
    ("budget_runs = -1", "campaign.race.budget_runs: must be >= 0"),
    ("round_seeds = 0", "campaign.race.round_seeds: must be >= 1"),
    ("interim_share = 0", "campaign.race.interim_share: must be > 0, got 0"),
    ("interim_share = 1.5", "campaign.race.interim_share: must be <= 1, got 1.5"),
    ('max_seeds = "all"', "campaign.race.max_seeds: expected an integer"),
    ('threshold = "high"', "campaign.race.threshold: expected a number or \"none\""),
    ("min_seeds = 3\nmax_seeds = 2", "campaign.race.max_seeds: must be >= min_seeds (3), got 2"),
    ("min_seeds = 6", "campaign.race.min_seeds: is 6 but [campaign] seeds holds 5"),
    ("max_seeds = 9", "campaign.race.max_seeds: is 9 but [campaign] seeds holds 5"),
    ("budget_runs = 5", "is 5, fewer than the first round's 6 runs (2 conditions x min_seeds 3)"),
    ('metric = "steps_to_threshold"', "campaign.race.threshold: metric = \"steps_to_threshold\" "
                                      "counts steps to a reward threshold: set threshold"),
    ("threshold = 0.5", "campaign.race.threshold: is only read by steps_to_threshold"),
])
def test_bad_race_keys_are_one_line_naming_the_key(race, message):
    text = _error(race)
    assert message in text and len(text.splitlines()) == 1, text


def test_a_race_needs_two_conditions_and_a_table():
    one = "[campaign]\nseeds = [1, 2, 3]\n[campaign.race]\n"
    assert "campaign.race: a race needs at least 2 conditions" in _error("", one)
    grid = '[campaign]\nseeds = [1, 2, 3]\n[campaign.grid]\n"training.lr" = [1e-4, 1e-3]\n' \
           "[campaign.race]\n"
    _load("", grid)  # two grid cells are two conditions
    bad = "[campaign]\nseeds = [1, 2, 3]\nrace = 3\n"
    assert "campaign.race: must be a table ([campaign.race]), got 3" in _error("", bad)


def test_a_metric_the_runs_do_not_produce_is_named_with_its_condition():
    cfg = Config()
    no_eval = Config()
    no_eval.data.eval_size = 0
    sft_only = Config()
    sft_only.training.max_steps = 0
    assert run_issues(RacePlan(metric="eval_accuracy"), {"a": cfg, "b": cfg}) == []
    (issue,) = run_issues(RacePlan(metric="best_eval"), {"a": cfg, "b": no_eval, "c": no_eval})
    assert issue.key == "campaign.race.metric" and "condition 'b' has data.eval_size = 0" \
        in issue.message
    (issue,) = run_issues(RacePlan(), {"a": sft_only})
    assert "training.max_steps = 0" in issue.message


def test_race_keys_can_be_set_on_the_command_line_and_are_checked_there():
    from retrain.config.overrides import parse_set_args

    sets = parse_set_args(["campaign.race.min_seeds=2", "campaign.race.metric=eval_accuracy",
                           "campaign.race.margin=0.02"])
    assert sets == {"campaign.race.min_seeds": 2, "campaign.race.metric": "eval_accuracy",
                    "campaign.race.margin": 0.02}
    raw = loader.parse_toml(CAMPAIGN, "race.toml")
    _, plan = loader.parse(loader.config.apply_overrides(raw, sets), "race.toml")
    assert race_of(plan.race) == RacePlan(min_seeds=2, metric="eval_accuracy", margin=0.02)
    for item, message in [("campaign.race.min_seed=2", "unknown key (did you mean 'min_seeds'?)"),
                          ("campaign.race.min_seeds=1", "must be >= 2, got 1"),
                          ("campaign.race.direction=up", '"up" is not allowed')]:
        with pytest.raises(ConfigError) as info:
            parse_set_args([item])
        assert message in str(info.value) and len(str(info.value).splitlines()) == 1


@pytest.mark.parametrize("metric, natural", [
    ("final_reward", "max"), ("eval_accuracy", "max"), ("best_eval", "max"),
    ("eval_mean_at_k", "max"), ("eval_pass_at_k", "max"), ("steps_to_threshold", "min"),
    ("seconds_to_threshold", "min")])
def test_each_metric_is_raced_its_own_way_and_a_contrary_direction_is_refused(metric, natural):
    threshold = "\nthreshold = 0.5" if natural == "min" else ""
    table = f'metric = "{metric}"{threshold}'
    assert race_of(_load(table)[1].race).direction == natural  # left out: the metric's way
    assert race_of(_load(f'{table}\ndirection = "{natural}"')[1].race).direction == natural
    contrary = "max" if natural == "min" else "min"
    text = _error(f'{table}\ndirection = "{contrary}"')
    assert len(text.splitlines()) == 1 and "campaign.race.direction" in text, text
    assert f'is "{contrary}" but metric = "{metric}" is always raced "{natural}"' in text
    assert f'set direction = "{natural}"' in text


def test_a_contrary_direction_set_on_the_command_line_is_refused_too():
    raw = loader.parse_toml(CAMPAIGN + 'metric = "steps_to_threshold"\nthreshold = 0.5',
                            "race.toml")
    sets = {"campaign.race.direction": "max"}
    with pytest.raises(ConfigError, match="campaign.race.direction: is \"max\""):
        loader.parse(loader.config.apply_overrides(raw, sets), "race.toml")


def test_explain_prints_the_direction_the_race_will_use(tmp_path, capsys):
    from retrain.cli.app import run_app

    path = tmp_path / "race.toml"
    path.write_text(CAMPAIGN + 'metric = "steps_to_threshold"\nthreshold = 0.5\n')
    assert run_app(["explain", str(path)]) == 0
    assert "race           steps_to_threshold (min, threshold 0.5)" in capsys.readouterr().out


def test_the_resolution_of_a_race_figure_is_its_grid_step():
    from retrain.campaign.race_plan import resolution

    small, large = Config(), Config()
    small.data.eval_size, large.data.eval_size = 16, 64
    runs = {"a": small, "b": large}
    assert resolution(RacePlan(metric="eval_accuracy"), runs) == 1 / 16  # the coarsest
    assert resolution(RacePlan(metric="best_eval"), {"b": large}) == 1 / 64
    assert resolution(RacePlan(metric="steps_to_threshold", threshold=0.5), runs) == 1.0
    assert resolution(RacePlan(), runs) == 0.0  # a mean reward: no known grid
    assert resolution(RacePlan(metric="seconds_to_threshold", threshold=0.5), runs) == 0.0


def test_the_sampled_evals_figures_are_raced_by_their_row_names():
    """eval_mean_at_k / eval_pass_at_k need training.eval_samples > 1 in every condition; the
    variance floor of mean@k is one of problems x k outcomes, of pass@k one of problems."""
    from retrain.campaign.race_plan import resolution

    assert race_of(_load('metric = "eval_mean_at_k"')[1].race).metric == "eval_mean_at_k"
    sampled, greedy = Config(), Config()
    sampled.data.eval_size, sampled.training.eval_samples = 16, 8
    greedy.data.eval_size = 16
    for metric in ("eval_mean_at_k", "eval_pass_at_k"):
        assert run_issues(RacePlan(metric=metric), {"a": sampled, "b": sampled}) == []
        (issue,) = run_issues(RacePlan(metric=metric), {"a": sampled, "b": greedy})
        assert "condition 'b' has training.eval_samples = 1" in issue.message
    assert resolution(RacePlan(metric="eval_mean_at_k"), {"a": sampled}) == 1 / (16 * 8)
    assert resolution(RacePlan(metric="eval_pass_at_k"), {"a": sampled}) == 1 / 16


def test_explain_names_an_interim_share_other_than_the_default(tmp_path, capsys):
    from retrain.cli.app import run_app

    path = tmp_path / "race.toml"
    path.write_text(CAMPAIGN + "interim_share = 0.5\n")
    assert run_app(["explain", str(path)]) == 0
    assert ", interim share 0.5: decisions after" in capsys.readouterr().out
    path.write_text(CAMPAIGN)
    assert run_app(["explain", str(path)]) == 0
    assert "interim share" not in capsys.readouterr().out

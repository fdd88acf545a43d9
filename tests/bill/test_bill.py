"""The bill's pure core (retrain/bill) and its keys: [cost] prices, [training] and [campaign]
budgets, bad values in one line naming the key."""

from __future__ import annotations

import pytest

from retrain.bill.prices import Budget, Prices, crossed, price
from retrain.bill.tally import Tally
from retrain.config.cost_section import prices
from retrain.config.loader import loads_config
from retrain.config.schema import ConfigError


def test_a_runs_tally_is_the_sum_of_its_rows_and_ignores_junk():
    rows = [{"prefill_tokens": 100, "sampled_tokens": 40, "trained_tokens": 130,
             "judge_input_tokens": 7, "judge_output_tokens": 2, "wall_s": 1.5},
            {"prefill_tokens": 50, "sampled_tokens": 10, "trained_tokens": None,
             "wall_s": "x"},
            {"step": 3}]  # a row from before token accounting
    t = Tally.of_rows(rows)
    assert (t.prefill, t.sampled, t.trained, t.judge_input, t.judge_output) == \
        (150, 50, 130, 7, 2)
    assert t.tokens == 330 and t.wall_s == 1.5
    assert Tally.from_dict(t.as_dict()) == t


def test_prices_apply_per_million_tokens_and_per_device_hour():
    t = Tally(prefill=2_000_000, sampled=500_000, trained=1_000_000, wall_s=1800.0)
    bill = price(t, Prices(prefill_per_mtok=0.1, sample_per_mtok=0.3, train_per_mtok=0.4,
                           device_hour=2.0))
    assert bill.usd == pytest.approx(0.2 + 0.15 + 0.4 + 1.0) and bill.unpriced == []


def test_no_price_gives_no_dollar_figure_and_names_what_is_unpriced():
    t = Tally(prefill=10, sampled=5, judge_input=3, wall_s=60.0)
    assert price(t, Prices()).usd is None
    part = price(t, Prices(sample_per_mtok=1.0))
    assert part.usd == pytest.approx(5e-6)
    assert part.unpriced == ["prefill tokens", "judge input tokens", "device-hours"]


def test_a_budget_is_crossed_at_its_figure_not_before():
    p = Prices(device_hour=3600.0)  # a dollar a second
    money = Budget(usd=2.0)
    assert crossed(Tally(wall_s=1.5), p, money) is None
    assert "training.budget_usd = $2.00" in crossed(Tally(wall_s=2.0), p, money)
    tokens = Budget(tokens=100)
    assert crossed(Tally(prefill=50, sampled=49), p, tokens) is None
    assert "100 tokens" in crossed(Tally(prefill=50, sampled=49, trained=1), p, tokens)
    assert crossed(Tally(prefill=10**9), Prices(), Budget()) is None  # no budget


def test_cost_section_reads_none_as_unpriced():
    cfg = loads_config('[cost]\nsample_per_mtok = 0.5\ndevice_hour = 0\n')
    assert prices(cfg.cost) == Prices(sample_per_mtok=0.5, device_hour=0.0)
    assert prices(loads_config("[cost]\n").cost) == Prices()


@pytest.mark.parametrize(("text", "key", "says"), [
    ('[cost]\nsample_per_mtok = -1', "cost.sample_per_mtok", "must be >= 0"),
    ('[cost]\ndevice_hour = "cheap"', "cost.device_hour", 'expected a number or "none"'),
    ('[training]\nbudget_usd = -2', "training.budget_usd", "must be >= 0"),
    ('[training]\nbudget_tokens = "lots"', "training.budget_tokens", "expected an integer"),
    ('[training]\nbudget_usd = 5', "training.budget_usd", "needs a price"),
    ('[campaign]\nseeds = [1, 2]\nbudget_usd = 5', "campaign.budget_usd", "needs a price"),
    ('[campaign]\nseeds = [1, 2]\nbudget_tokens = -5', "campaign.budget_tokens",
     "must be >= 0"),
])
def test_bad_cost_and_budget_values_name_the_key(text, key, says):
    with pytest.raises(ConfigError) as err:
        loads_config(text, "exp.toml")
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"exp.toml: {key}") and says in line, line


def test_device_hours_count_every_rank_and_older_rows_one_device():
    rows = [{"wall_s": 1800.0, "device_s": 3600.0, "world_size": 2},  # a 2-rank run's row
            {"wall_s": 1800.0}]                                        # a row from before
    t = Tally.of_rows(rows)
    assert t.wall_s == 3600.0 and t.device_hours == pytest.approx(1.5)
    assert Tally.from_dict(t.as_dict()).device_hours == pytest.approx(1.5)
    assert Tally.from_dict({"wall_s": 7200.0}).device_hours == pytest.approx(2.0)
    assert price(t, Prices(device_hour=2.0)).usd == pytest.approx(3.0)

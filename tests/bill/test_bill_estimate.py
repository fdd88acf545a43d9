"""The bill before a run (issue 55): `retrain explain`'s upper bound against a hand count on
the tiny model, its expected figure from a real pilot's rows, a race's fewest and most runs in
money, and the prices line with and without [cost]."""

from __future__ import annotations

import json

import pytest

from retrain.bill.estimate import RunShape, bound, pilot_rates
from retrain.bill.tally import Tally
from retrain.cli.explain.dry_run import build_report, plain_lines
from retrain.config import toml_io
from tests.run_helpers import rows, run_in_process, write_config

PROMPTS = ("What is 2 + 3?", "Name three prime numbers greater than ten, please.", "Hi",
           "What is the capital of France?", "Sum 1, 2, 3 and 4.", "Is 91 a prime number?")


def _line(report, key: str) -> str:
    return next(v for k, v in report.cost.lines if k == key)


def test_the_bound_is_the_hand_count_of_the_config_and_the_data(tmp_path, tiny_model,
                                                                 monkeypatch):
    lines = [json.dumps({"prompt": p, "answer": "5"}) for p in PROMPTS]
    (tmp_path / "known.jsonl").write_text("\n".join(lines) + "\n")
    path = write_config(tmp_path, data={"source": "jsonl", "path": "known.jsonl",
                                        "eval_size": 2, "chat_template": False,
                                        "instruction": ""},
                        training={"max_steps": 5, "eval_every": 2, "epochs": 2},
                        algorithm={"kl_coef": 0.1})
    monkeypatch.chdir(tmp_path)
    report = build_report(path)
    from transformers import AutoTokenizer

    from retrain.config.loader import load_config
    from retrain.environments.tasks import load_task

    # by hand: chat_template off and no instruction, so a prompt's tokens are its text's
    tok = AutoTokenizer.from_pretrained(tiny_model)
    held = {p.prompt for p in load_task(load_config(path).data, 3, tmp_path).eval}
    length = {p: len(tok(p)["input_ids"]) for p in PROMPTS}
    longest = max(n for p, n in length.items() if p not in held)
    b, g, m, steps, evals = 2, 4, 8, 5, 1 + 3  # evals: before step 1, after 2, 4 and 5
    datum = longest + m
    assert report.cost.bound == Tally(
        prefill=steps * (b * longest + b * g * datum) + evals * sum(length[p] for p in held),
        sampled=steps * b * g * m + evals * 2 * m,
        trained=steps * b * g * datum * 2)
    assert report.cost.left_out == []
    assert _line(report, "cost bound").startswith(
        f"the run: at most {report.cost.bound.tokens:,} tokens (prefill ")


def test_the_bound_says_what_it_leaves_out():
    assert bound(RunShape(steps=2, batch=1, group=2, max_tokens=4, prompt_tokens=None,
                          judge=True)).left_out == ["prompt tokens", "judge tokens"]
    # back-pressure's ceiling and refill's rounds widen the prompts sampled per step
    assert bound(RunShape(steps=1, batch=4, rounds=3, group=2, max_tokens=5,
                          prompt_tokens=10)).tally == Tally(prefill=4 * 3 * 10,
                                                             sampled=4 * 3 * 2 * 5,
                                                             trained=4 * 2 * 15)


def test_the_expected_figure_scales_a_real_pilots_rows(tmp_path, tiny_model, monkeypatch):
    path = write_config(tmp_path, data={"source": "arithmetic", "eval_size": 4},
                        training={"max_steps": 3}, cost={"sample_per_mtok": 1000.0})
    done = run_in_process([path], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    got = rows(tmp_path / "logs" / "run")
    first, plain, last = (Tally.of_row(r) for r in got)  # evals on the first and last rows
    monkeypatch.chdir(tmp_path)
    report = build_report(path, {"training.max_steps": 6})
    # 6 plain steps and the 2 evaluations' extra (what the first and last rows spent beyond
    # the plain one); evaluations train nothing: trained is each row's mean x 6
    want = Tally(prefill=4 * plain.prefill + first.prefill + last.prefill,
                 sampled=4 * plain.sampled + first.sampled + last.sampled,
                 trained=round((first.trained + plain.trained + last.trained) / 3) * 6)
    assert first.sampled > plain.sampled and last.sampled > plain.sampled  # the evaluations
    e = report.cost.expected
    assert (e.prefill, e.sampled, e.trained) == (want.prefill, want.sampled, want.trained)
    assert report.cost.expected_usd == pytest.approx(e.sampled * 1000 / 1e6)
    assert f"; from {report.pilot.run}'s rows" in _line(report, "cost expected")
    # the pilot's own measured spend never passes its config's bound
    pilot_bound = build_report(path).cost.bound
    spent = Tally.of_rows(got)
    assert spent.prefill <= pilot_bound.prefill and spent.sampled <= pilot_bound.sampled
    assert spent.trained <= pilot_bound.trained


def test_pilot_rates_split_a_step_from_an_evaluation():
    step, ev = Tally(sampled=10, wall_s=1.0), Tally(sampled=6, wall_s=0.5)
    per_step, per_eval = pilot_rates([(step + ev, 1), (step, 0), (step, 0), (step + ev, 1)])
    assert (per_step, per_eval) == (step, ev)
    trains = Tally(trained=30)  # evaluations train nothing: trained is every row's mean
    per_step, per_eval = pilot_rates([(trains, 1), (Tally(trained=60), 0), (trains, 1)])
    assert (per_step.trained, per_eval.trained) == (40, 0)
    assert pilot_rates([(step, 1), (step, 1)]) == (step, Tally())  # no plain row: steps only


RACE = """
[campaign]
seeds = [1, 2, 3, 4]
[[campaign.conditions]]
name = "a"
[[campaign.conditions]]
name = "b"
"training.lr" = 0.002
[campaign.race]
metric = "final_reward"
min_seeds = 2
"""


def _race_config(tmp_path, cost: dict | None):
    raw = {"model": {"name": "tiny-random"}, "data": {"source": "arithmetic", "eval_size": 0,
                                                      "chat_template": False},
           "training": {"batch_size": 1, "group_size": 2, "max_tokens": 5, "max_steps": 3},
           "logging": {"log_dir": "logs"}}
    if cost:
        raw["cost"] = cost
    path = tmp_path / "race.toml"
    path.write_text(toml_io.dumps(raw) + RACE)
    return path


def test_a_race_shows_its_fewest_and_most_runs_in_money_or_tokens(tmp_path, tiny_model,
                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    tokens = build_report(_race_config(tmp_path, None))
    per_run = tokens.cost.bound.tokens // 8  # 2 conditions x 4 seeds, all the same shape
    assert tokens.cost.bound.sampled == 8 * 3 * 2 * 5
    assert _line(tokens, "race cost") == (
        f"fewest runs (4) at most {4 * per_run:,} tokens, most runs (8) at most "
        f"{8 * per_run:,} tokens (each run at the dearest run's bound)")
    priced = build_report(_race_config(tmp_path, {"sample_per_mtok": 10000.0}))
    sampled = 3 * 2 * 5  # a run's sampled tokens, the only priced part: $0.30 each
    assert _line(priced, "race cost").startswith(
        f"fewest runs (4) at most ${4 * sampled * 0.01:.2f} (prefill tokens, trained tokens "
        f"unpriced), most runs (8) at most ${8 * sampled * 0.01:.2f}")


def test_explain_names_its_prices_or_says_there_are_none(tmp_path, tiny_model, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_config(tmp_path, cost={"sample_per_mtok": 2.0, "device_hour": 1.5})
    lines = "\n".join(plain_lines(build_report(path)))
    assert f"prices         sample_per_mtok $2.00; device_hour $1.50 ([cost] in {path})" \
        in lines
    assert "device-hours not bounded" in lines  # a bound has no wall time to price
    bare = write_config(tmp_path, "bare")
    lines = "\n".join(plain_lines(build_report(bare)))
    assert "prices         no prices: tokens and device-hours only" in lines
    assert "$" not in next(v for v in lines.splitlines() if "cost bound" in v)

"""The environment kinds: the registry, the task kind, the user's python kind, guess_number."""

from __future__ import annotations

from pathlib import Path

import pytest

from retrain.config.sections import DataConfig, EnvironmentConfig
from retrain.environments.kinds import (
    KINDS,
    KindContext,
    MissingExtra,
    build_factory,
    builder,
    default_max_turns,
)
from retrain.environments.tasks import load_task, prompt_text
from retrain.errors import UserError

ENVS = Path(__file__).parents[1] / "data" / "envs"


def ctx(split="train", config_dir=ENVS, **kw) -> KindContext:
    return KindContext(split=split, config_dir=config_dir, seed=7, **kw)


def test_every_kind_of_the_config_has_a_builder_name():
    from retrain.config.sections import ENVIRONMENT_KINDS

    assert set(ENVIRONMENT_KINDS) == set(KINDS)
    assert all(":" in spec for spec in KINDS.values())


def test_an_unknown_kind_names_the_kinds():
    with pytest.raises(UserError, match="guess_number"):
        builder("nope")


def test_missing_extra_is_one_line_naming_pip():
    msg = str(MissingExtra("reasoning-gym"))
    assert "\n" not in msg and "pip install 'retrain[environments]'" in msg


def test_task_kind_is_the_data_split_one_turn():
    data = DataConfig(size=20, eval_size=5)
    splits = load_task(data, 7, ENVS)
    for split, problems in (("train", splits.train), ("eval", splits.eval)):
        env = build_factory(EnvironmentConfig(), ctx(split, data=data))()
        assert env.reset(3) == [{"role": "user", "content": prompt_text(problems[3], data)}]
        right = env.step(f"\\boxed{{{problems[3].answer}}}")
        assert (right.done, right.reward, right.messages) == (True, 1.0, [])
        env.reset(3)
        assert env.step("no idea").reward == 0.0


@pytest.mark.parametrize("factory", ["counter_env.py:CountTo", "counter_env:make_count_to"])
def test_python_kind_builds_the_users_environment_with_params(factory):
    cfg = EnvironmentConfig(kind="python", factory=factory, params={"target": 2})
    make = build_factory(cfg, ctx())
    env = make()
    assert "1 to 2" in env.reset(0)[0]["content"]
    assert not env.step("1").done
    last = env.step("2")
    assert last.done and last.reward == 1.0
    assert make() is not env  # one instance per episode


@pytest.mark.parametrize("factory, message", [
    ("", "needs environment.factory"),
    ("missing.py:Env", "no file"),
    ("counter_env.py:Nope", "has no function 'Nope'"),
    ("counter_env.py:not_an_env", "no reset"),
    ("counter_env.py:NOT_AN_ENV", "not a function"),
])
def test_python_kind_errors_are_one_line(factory, message):
    with pytest.raises(UserError, match=message) as info:
        build_factory(EnvironmentConfig(kind="python", factory=factory), ctx())
    assert "\n" not in str(info.value)


def test_python_kind_bad_params_name_the_key():
    cfg = EnvironmentConfig(kind="python", factory="counter_env.py:CountTo",
                            params={"targte": 2})
    with pytest.raises(UserError, match="targte"):
        build_factory(cfg, ctx())


def test_guess_number_plays_higher_lower_and_rewards_the_hit():
    env = build_factory(EnvironmentConfig(kind="guess_number",
                                          params={"low": 1, "high": 8}), ctx())()
    env.reset(42)
    lo, hi, turns = 1, 8, 0
    while True:
        guess = (lo + hi) // 2
        turns += 1
        step = env.step(f"My guess: {guess}")
        if step.done:
            break
        said = step.messages[0]["content"]
        lo, hi = (guess + 1, hi) if said == "Higher." else (lo, guess - 1)
    assert step.reward == 1.0 and turns <= 4
    assert "one whole number" in env.step("dunno").messages[0]["content"]


def test_guess_number_same_seed_same_secret_and_bad_params():
    make = build_factory(EnvironmentConfig(kind="guess_number"), ctx())
    a, b = make(), make()
    a.reset(5), b.reset(5)
    assert a.secret == b.secret
    with pytest.raises(UserError, match="low"):
        build_factory(EnvironmentConfig(kind="guess_number", params={"low": 9, "high": 2}),
                      ctx())


def test_default_max_turns():
    assert default_max_turns(EnvironmentConfig()) == 1
    assert default_max_turns(EnvironmentConfig(kind="python")) == 8
    assert default_max_turns(EnvironmentConfig(kind="python", max_turns=3)) == 3


def test_guess_number_format_reward_pays_numbers_in_range_only():
    make = build_factory(EnvironmentConfig(kind="guess_number", params={
        "low": 1, "high": 8, "format_reward": 0.1}), ctx())
    env = make()
    env.reset(42)
    wrong = next(n for n in range(1, 9) if n != env.secret)
    assert env.step(str(wrong)).reward == pytest.approx(0.1)
    assert env.step("99").reward == 0.0 and env.step("none").reward == 0.0
    hit = env.step(str(env.secret))
    assert hit.done and hit.reward == pytest.approx(1.1) and hit.metrics["correct"] == 1.0

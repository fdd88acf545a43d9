"""The library adapters as Environments: reasoning_gym and textarena (each skips with the
reason when its extra is absent). Training through the rollout:
tests/environments/test_env_adapters_train.py."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from retrain.config.sections import EnvironmentConfig
from retrain.environments.kinds import KindContext, build_factory
from retrain.errors import UserError

TRAIN = KindContext(split="train", config_dir=Path("."), seed=7)
EVAL = KindContext(split="eval", config_dir=Path("."), seed=7)


def factory(ctx: KindContext = TRAIN, **section):
    return build_factory(EnvironmentConfig(**section), ctx)


# ---------------------------------------------------------------------------- reasoning_gym


@pytest.fixture
def rg():
    return pytest.importorskip("reasoning_gym",
                               reason="reasoning-gym is not installed: pip install "
                                      "'retrain[environments]'")


def rg_factory(ctx: KindContext = TRAIN, **section):
    return factory(ctx, kind="reasoning_gym", **section)


def test_reasoning_gym_item_by_seed_and_score_of_the_answer_tag(rg):
    env = rg_factory(task="basic_arithmetic", size=50)()
    system, user = env.reset(3)
    assert system["role"] == "system" and "<answer>" in system["content"]
    expected = rg.create_dataset("basic_arithmetic", size=50, seed=7)[3]
    assert user == {"role": "user", "content": expected["question"]}
    assert env.reset(53) == env.reset(3)  # seed -> item seed % size
    right = env.step(f"Let me see. <answer> {expected['answer']} </answer>")
    assert (right.reward, right.done, right.metrics["correct"]) == (1.0, True, 1.0)
    assert env.step(expected["answer"]).reward == 0.0  # no <answer> tag, no reward
    assert env.step("<answer>nonsense</answer>").reward == 0.0


def test_reasoning_gym_partial_credit_unless_binary(rg):
    env = rg_factory(task="basic_arithmetic", size=10)()
    env.reset(0)
    partial = f"<answer>{env.entry['answer']} apples</answer>"
    score = env.step(partial).reward
    assert 0.0 < score < 1.0
    binary = rg_factory(task="basic_arithmetic", size=10, binary=True)()
    binary.reset(0)
    step = binary.step(partial)
    assert step.reward == 0.0 and step.metrics["score"] == score


def test_reasoning_gym_params_and_the_held_out_split(rg):
    env = rg_factory(task="basic_arithmetic", params={"min_terms": 2, "max_terms": 2,
                                                      "max_digits": 1})()
    numbers = [re.findall(r"\d+", env.reset(s)[1]["content"]) for s in range(20)]
    assert all(len(n) == 2 and max(map(len, n)) == 1 for n in numbers), numbers
    held_out = rg_factory(EVAL, task="basic_arithmetic")()
    train = rg_factory(task="basic_arithmetic")()
    assert [held_out.reset(s) for s in range(5)] != [train.reset(s) for s in range(5)]


def test_reasoning_gym_weighted_mix_scores_each_item_by_its_task(rg):
    env = rg_factory(tasks={"basic_arithmetic": 1, "leg_counting": 1},
                     params={"leg_counting": {"min_animals": 1, "max_animals": 2}}, size=40)()
    sources = set()
    for seed in range(40):
        env.reset(seed)
        sources.add(env.entry["metadata"]["source_dataset"])
        assert env.step(f"<answer>{env.entry['answer']}</answer>").reward == 1.0
    assert sources == {"basic_arithmetic", "leg_counting"}


def test_reasoning_gym_format_reward_shapes_the_reward_not_the_success(rg):
    plain = rg_factory(task="basic_arithmetic", size=10, binary=True)()
    shaped = rg_factory(task="basic_arithmetic", size=10, binary=True, format_reward=0.25)()
    for env in (plain, shaped):
        env.reset(0)
    answer = plain.entry["answer"]
    wrong = f"<answer>{int(answer) + 1}</answer>"
    # default 0: today's rewards; the metric counts tagged replies either way
    assert [plain.step(r).reward for r in (wrong, f"<answer>{answer}</answer>", answer)] \
        == [0.0, 1.0, 0.0]
    steps = [shaped.step(r) for r in (wrong, f"<answer>{answer}</answer>", answer,
                                        "<answer></answer>")]
    assert [s.reward for s in steps] == [0.25, 1.25, 0.0, 0.0]
    assert [s.metrics["correct"] for s in steps] == [0.0, 1.0, 0.0, 0.0]
    assert [s.metrics["formatted"] for s in steps] == [1.0, 1.0, 0.0, 0.0]


def test_reasoning_gym_examples_are_solved_turns_shared_by_both_splits(rg):
    env = rg_factory(task="basic_arithmetic", size=50, examples=2)()
    messages = env.reset(3)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user",
                                             "assistant", "user"]
    shots = rg.create_dataset("basic_arithmetic", size=2, seed=7 + 2_000_003)
    assert messages[1:5] == [
        {"role": "user", "content": shots[0]["question"]},
        {"role": "assistant", "content": f"<answer>{shots[0]['answer']}</answer>"},
        {"role": "user", "content": shots[1]["question"]},
        {"role": "assistant", "content": f"<answer>{shots[1]['answer']}</answer>"}]
    assert messages[-1] == rg_factory(task="basic_arithmetic", size=50)().reset(3)[-1]
    held_out = rg_factory(EVAL, task="basic_arithmetic", size=50, examples=2)().reset(3)
    assert held_out[1:5] == messages[1:5] and held_out[-1] != messages[-1]


@pytest.mark.parametrize(("section", "message"), [
    ({"task": "basic_arithmetc"}, "no task 'basic_arithmetc'; did you mean 'basic_arithmetic'"),
    ({}, "needs task = 'NAME' or a weighted tasks"),
    ({"task": "basic_arithmetic", "tasks": {"chain_sum": 1}}, "not both"),
    ({"task": "basic_arithmetic", "params": {"foo": 1}}, "does not take these settings.*"
                                                         "it takes min_terms"),
    ({"task": "basic_arithmetic", "params": {"min_terms": 5, "max_terms": 2}},
     "rejects this config"),
    ({"task": "basic_arithmetic", "params": {"seed": 1}}, "comes from training.seed"),
    ({"tasks": {"chain_sum": 0}}, "weight must be a positive number"),
    ({"tasks": {"chain_sum": float("inf")}}, "weight must be a positive number"),
    ({"tasks": {"chain_sum": 1e308, "basic_arithmetic": 1e308}}, "the weights sum past"),
    ({"tasks": {"chain_sum": 1}, "params": {"basic_arithmetic": {}}}, "not in tasks"),
    ({"tasks": {"chain_sum": 1}, "params": {"chain_sum": {"bad": 1}}},
     r"environment.params.chain_sum: chain_sum does not take"),
    ({"task": "graph_color", "examples": 1}, "environment.examples: this task has no "
                                             "reference answers"),
])
def test_reasoning_gym_bad_sections_are_one_line_errors(rg, section, message):
    with pytest.raises(UserError, match=message) as info:
        rg_factory(**section)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------- textarena


@pytest.fixture
def ta():
    return pytest.importorskip("textarena", reason="textarena is not installed: pip install "
                                                   "'retrain[environments]'")


def test_textarena_guess_the_number_plays_to_a_win(ta):
    env = factory(kind="textarena", id="GuessTheNumber-v0")()
    [opening] = env.reset(3)
    assert opening["role"] == "user" and "Guess The Number" in opening["content"]
    low, high, step = 1, 20, None
    for _ in range(10):
        guess = (low + high) // 2
        step = env.step(f"My guess: [{guess}]")
        if step.done:
            break
        [hint] = step.messages
        assert hint["role"] == "user" and "[" not in hint["content"]  # our move is not echoed
        low, high = (guess + 1, high) if "higher" in hint["content"] else (low, guess - 1)
    assert step.done and step.metrics == {"invalid_move": 0.0}
    assert env.close() == 1.0


def test_textarena_unfinished_game_scores_zero_and_params_reach_the_game(ta):
    env = factory(kind="textarena", id="GuessTheNumber-v0-raw",
                  params={"max_number": 50, "max_turns": 3})()
    [opening] = env.reset(5)
    assert "between 1 and 50 within 3 turns" in opening["content"]
    target = env.game.state.game_state["game_number"]
    step = env.step(f"[{1 if target != 1 else 2}]")
    assert not step.done and step.messages[0]["content"].startswith("The target number is")
    assert env.close() == 0.0


def test_textarena_same_seed_same_game(ta):
    make = factory(kind="textarena", id="GuessTheNumber-v0")
    targets = []
    for seed in (11, 11, 12, 13, 14):
        env = make()
        env.reset(seed)
        targets.append(env.game.state.game_state["game_number"])
    assert targets[0] == targets[1] and len(set(targets)) > 1


@pytest.mark.parametrize(("game_id", "message"), [
    ("Wordle-v0", "needs data textarena downloads on first use"),
    ("TicTacToe-v0", "only single-player games"),
    ("GuessTheNumbr-v0", "did you mean 'GuessTheNumber-v0'"),
    ("", "name the textarena game"),
])
def test_textarena_games_that_cannot_run_here_are_clear_errors(ta, capfd, game_id, message):
    with pytest.raises(UserError, match=message) as info:
        factory(kind="textarena", id=game_id)
    assert "\n" not in str(info.value)
    assert "nltk" not in capfd.readouterr().out  # the download failure stays off stdout


# ---------------------------------------------------------------------------- missing extras


@pytest.mark.parametrize(("section", "module", "pip"), [
    ({"kind": "reasoning_gym", "task": "basic_arithmetic"}, "reasoning_gym", "environments"),
    ({"kind": "textarena", "id": "GuessTheNumber-v0"}, "textarena", "environments"),
    ({"kind": "verifiers", "id": "x"}, "verifiers", "verifiers"),
])
def test_a_missing_extra_is_one_line_naming_the_pip_command(monkeypatch, section, module, pip):
    from retrain.environments.kinds import MissingExtra

    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(MissingExtra) as info:
        factory(**section)
    message = str(info.value)
    assert "\n" not in message and f"pip install 'retrain[{pip}]'" in message

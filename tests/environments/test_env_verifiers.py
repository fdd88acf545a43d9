"""The verifiers adapter: a MultiTurnEnv and a ToolEnv in the classic API (defined in
tests/data/verifiers/vf_test_envs.py), driven turn by turn through our Environment protocol.
Skips with the reason when verifiers is not installed."""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path

import pytest

from retrain.config.sections import EnvironmentConfig
from retrain.environments.kinds import KindContext, build_factory
from retrain.errors import UserError

# Not imported here: collecting the suite would import verifiers (~2 s) in every worker.
pytestmark = pytest.mark.skipif(find_spec("verifiers") is None, reason="verifiers is not "
                                "installed: pip install 'retrain[verifiers]'")

HERE = Path(__file__).parents[1] / "data" / "verifiers"
CTX = KindContext(split="train", config_dir=HERE, seed=0)


@pytest.fixture(scope="module")
def guess():
    return build_factory(EnvironmentConfig(kind="verifiers", id="vf_test_envs"), CTX)


@pytest.fixture(scope="module")
def tools():
    return build_factory(EnvironmentConfig(kind="verifiers", id="vf_test_envs",
                                           params={"kind": "tools"}, tool_max_chars=40), CTX)


def call(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_multiturn_env_hints_until_solved_and_the_rubric_scores(guess):
    env = guess()
    assert env.reset(2) == [{"role": "user", "content": "Guess my number between 1 and 9."}]
    assert env.tool_schemas == []
    assert env.step("5").messages == [{"role": "user", "content": "lower"}]
    assert env.step("I say 2").messages == [{"role": "user", "content": "higher"}]
    last = env.step("3")  # final_env_response ends it; the model never sees "correct"
    assert last.done and last.messages == []
    assert last.reward == pytest.approx(1.0 + 0.1 / 3)
    assert last.metrics["solved"] == 1.0 and last.metrics["num_turns"] == 3.0
    assert env.close() == 0.0  # the reward came with the last step


def test_rows_by_seed_and_max_turns_of_the_environment(guess):
    env = guess()
    env.reset(10)  # row 10 % 8 = 2: answer 3
    for reply in ("1", "1", "1"):
        assert not env.step(reply).done
    last = env.step("1")  # max_turns = 4 in the environment
    assert last.done and last.reward == pytest.approx(0.1 / 4) and last.metrics["solved"] == 0
    env.close()


def test_an_episode_we_stop_early_is_scored_at_close(guess):
    env = guess()
    env.reset(0)
    env.step("9")
    assert env.close() == pytest.approx(0.1)  # fewer_turns = 1/1, not solved


def test_tool_env_runs_tool_calls_from_the_reply(tools):
    env = tools()
    [question] = env.reset(2)
    assert question["content"] == "What is 2 + 4? Use the add tool."
    assert [s["function"]["name"] for s in env.tool_schemas] == ["add", "nap", "shout"]
    assert env.tool_schemas[0]["function"]["parameters"]["required"] == ["a", "b"]
    step = env.step(call("add", a=2, b=4))
    assert step.messages == [{"role": "tool", "name": "add", "content": "6"}]
    assert step.metrics == {"tool_calls": 1.0} and not step.done
    positional = env.step("<tool_call>add(1, 2)</tool_call>")
    assert positional.messages[0]["content"] == "3"
    last = env.step("The sum is 6.")  # no tool call: ToolEnv stops, the rubric scores
    assert last.done and last.reward == 1.0 and last.metrics["add_calls"] == 2.0
    assert env.close() == 0.0


def test_tool_errors_go_back_as_text_and_output_is_cut(tools):
    env = tools()
    env.reset(1)
    bad = env.step(call("add", a=1))
    assert bad.messages[0]["content"].startswith("add() missing 1 required")
    long = env.step(call("shout", size=500)).messages[0]["content"]
    assert long == "A" * 40 + "\n[truncated: 460 more characters]"
    env.close()


def test_single_turn_env_is_one_turn():
    env = build_factory(EnvironmentConfig(kind="verifiers", id="vf_test_envs",
                                          params={"kind": "single"}), CTX)()
    assert env.reset(3) == [{"role": "user", "content": "Say 3."}]
    step = env.step("3")
    assert step.done and step.reward == 1.0
    assert env.close() == 0.0


def test_bad_sections_are_one_line_errors():
    with pytest.raises(UserError, match="name the installed verifiers environment"):
        build_factory(EnvironmentConfig(kind="verifiers"), CTX)
    with pytest.raises(UserError, match="importing it failed .No module named"):
        build_factory(EnvironmentConfig(kind="verifiers", id="no_such_env_here"), CTX)
    with pytest.raises(UserError, match="load_environment does not take these settings"):
        build_factory(EnvironmentConfig(kind="verifiers", id="vf_test_envs",
                                        params={"colour": 1}), CTX)

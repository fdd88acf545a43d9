"""Tools for environments: schemas, the call format, the wrapper, both render paths, the
built-in calculator, user tools and the `lookup` tool task."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import pytest

from retrain.config.sections import EnvironmentConfig
from retrain.environments.kinds import KindContext, build_factory
from retrain.environments.protocol import Environment, Step
from retrain.environments.tools import ToolEnvironment, with_tools
from retrain.environments.tools.builtin import calculator
from retrain.environments.tools.calls import parse_tool_calls
from retrain.environments.tools.lookup import LookupTask
from retrain.environments.tools.render import (
    for_template,
    template_declares_tools,
    to_text_protocol,
)
from retrain.environments.tools.schema import function_schema
from retrain.errors import UserError

DATA = Path(__file__).parents[1] / "data"


def call(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


class Echo(Environment):
    """A one-question environment: done on the first reply that is not a tool call."""

    def reset(self, seed: int) -> list[dict]:
        return [{"role": "user", "content": f"question {seed}"}]

    def step(self, reply: str) -> Step:
        return Step(reward=float(reply == "42"), done=True)


def wrapped(tools: list[str], max_chars: int = 2000) -> ToolEnvironment:
    env = with_tools(Echo, tools, max_chars, DATA / "tools")()
    env.reset(0)
    return env


# ---------------------------------------------------------------------------- schemas


def test_schema_from_type_hints_and_docstring():
    def search(query: str, limit: int = 5, mode: Literal["fast", "exact"] = "fast",
               tags: list[str] | None = None, scale: float = 1.0) -> str:
        """Search the notes.

        More text that is not the summary.

        Args:
            query: what to look for,
                over two lines.
            limit: at most this many hits.

        Returns:
            the hits.
        """
        return ""

    fn = function_schema(search)["function"]
    assert fn["name"] == "search" and fn["description"] == "Search the notes."
    props = fn["parameters"]["properties"]
    assert props["query"] == {"type": "string",
                              "description": "what to look for, over two lines."}
    assert props["limit"] == {"type": "integer", "description": "at most this many hits."}
    assert props["mode"] == {"enum": ["fast", "exact"]}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert props["scale"] == {"type": "number"}
    assert fn["parameters"]["required"] == ["query"]


def test_schema_of_a_bound_method_leaves_out_self():
    env = LookupTask()
    fn = function_schema(env.lookup)["function"]
    assert list(fn["parameters"]["properties"]) == ["key"]


# ---------------------------------------------------------------------------- the call format


def test_tool_calls_json_python_style_and_bare_json():
    names = {"lookup", "calculator"}
    [c] = parse_tool_calls('ok <tool_call>{"name": "lookup", "arguments": {"key": "a"}}'
                           "</tool_call> done", names)
    assert (c.name, c.kwargs, c.error) == ("lookup", {"key": "a"}, "")
    [c] = parse_tool_calls('<tool_call>\n{"name": "lookup", "arguments": "{\\"key\\": 1}"}\n'
                           "</tool_call>", names)
    assert c.kwargs == {"key": 1}
    [c] = parse_tool_calls("<tool_call>lookup('a', exact=True)</tool_call>", names)
    assert (c.name, c.args, c.kwargs) == ("lookup", ["a"], {"exact": True})
    [c] = parse_tool_calls('{"name": "calculator", "parameters": {"expression": "1+1"}}', names)
    assert c.kwargs == {"expression": "1+1"}
    assert parse_tool_calls('{"name": "other", "arguments": {}}', names) == []
    assert parse_tool_calls("the answer is 42", names) == []
    [a, b] = parse_tool_calls(call("lookup", key="x") + call("calculator", expression="2"),
                              names)
    assert (a.name, b.name) == ("lookup", "calculator")


def test_unreadable_tool_calls_carry_the_reason():
    names = {"lookup"}
    assert "not valid JSON" in parse_tool_calls("<tool_call>{bad</tool_call>", names)[0].error
    assert "name" in parse_tool_calls('<tool_call>{"x": 1}</tool_call>', names)[0].error
    assert "plain values" in parse_tool_calls("<tool_call>lookup(x)</tool_call>", names)[0].error
    assert parse_tool_calls("<tool_call>", names)[0].error  # cut off mid-call
    assert parse_tool_calls("<tool_call>lookup('a')", names)[0].args == ["a"]  # no closing tag


# ---------------------------------------------------------------------------- the wrapper


def test_a_reply_without_a_tool_call_goes_to_the_environment():
    env = wrapped(["calculator"])
    assert env.step("42") == Step(reward=1.0, done=True)


def test_the_calculator_runs_and_its_errors_come_back_as_text():
    env = wrapped(["calculator"])
    step = env.step(call("calculator", expression="(3 + 4) * 12") +
                    call("calculator", expression="1/0") +
                    call("calculator", expression="__import__('os')") +
                    call("nope") + "<tool_call>{oops</tool_call>")
    contents = [m["content"] for m in step.messages]
    assert contents[0] == "84"
    assert contents[1].startswith("error: ZeroDivisionError")
    assert contents[2].startswith("error: ValueError: unsupported")
    assert contents[3] == "error: no tool named 'nope'; tools: calculator"
    assert contents[4].startswith("error: the tool call is not valid JSON")
    assert [m["role"] for m in step.messages] == ["tool"] * 5
    assert (step.done, step.reward) == (False, 0.0)
    assert step.metrics == {"tool_calls": 5.0, "tool_errors": 4.0}


def test_calculator_refuses_huge_powers():
    with pytest.raises(ValueError, match="exponent"):
        calculator("9 ** 9 ** 9")
    assert calculator("2 ** 10 / 4") == "256"


def test_user_tools_from_a_file_and_bad_arguments():
    env = wrapped(["my_tools.py:reverse"])
    assert env.tool_schemas[0]["function"]["name"] == "reverse"
    assert env.step(call("reverse", text="abc")).messages[0]["content"] == "cba"
    bad = env.step(call("reverse", txt="abc")).messages[0]["content"]
    assert bad.startswith("error: TypeError") and "txt" in bad


def test_user_tools_from_a_module(monkeypatch):
    monkeypatch.syspath_prepend(str(DATA / "tools"))
    env = with_tools(Echo, ["my_tools:reverse", "calculator"], 100, Path("/nonexistent"))()
    assert [s["function"]["name"] for s in env.tool_schemas] == ["reverse", "calculator"]


@pytest.mark.parametrize(("spec", "message"), [
    ("abacus", "is not a built-in tool"),
    ("missing.py:f", "environment.tools = 'missing.py:f': no file"),
    ("my_tools.py:nothing", "has no function 'nothing'"),
    ("my_tools.py:count_up", "'my_tools.py:count_up': count_up is a generator function"),
    ("my_tools.py:Reverser", "'my_tools.py:Reverser': Reverser is a class; a tool is a "
                             "function"),
])
def test_bad_tool_names_are_user_errors(spec, message):
    with pytest.raises(UserError, match=message):
        with_tools(Echo, [spec], 100, DATA / "tools")


def test_an_async_tool_is_awaited():
    env = wrapped(["my_tools.py:later"])
    step = env.step(call("later", text="abc"))
    assert step.messages[0]["content"] == "cba" and "tool_errors" not in step.metrics


def test_a_tool_listed_twice_counts_once_and_two_tools_of_one_name_are_refused_at_start(
        monkeypatch):
    """Refused when the factory is built (the worker's start-up: the run stops with one
    line), not in every episode while the run exits 0."""
    env = wrapped(["my_tools.py:reverse", "calculator", "my_tools.py:reverse"])
    assert [s["function"]["name"] for s in env.tool_schemas] == ["reverse", "calculator"]
    monkeypatch.syspath_prepend(str(DATA / "tools"))
    with pytest.raises(UserError, match="'my_tools.py:reverse' and 'my_tools:reverse' are "
                                        "both named 'reverse'"):
        with_tools(Echo, ["my_tools.py:reverse", "my_tools:reverse"], 100, DATA / "tools")


def test_output_is_cut_to_tool_max_chars_and_prints_are_captured(capfd):
    env = wrapped(["my_tools.py:chatty"], max_chars=50)
    step = env.step(call("chatty", megabytes=10))
    content = step.messages[0]["content"]
    assert content.startswith("x" * 50 + "\n[truncated: ")
    assert len(content) < 100
    assert step.metrics == {"tool_calls": 1.0, "tool_truncated": 1.0}
    out, err = capfd.readouterr()
    assert "xxxx" not in out and "xxxx" not in err


def test_wrapping_twice_adds_tools_to_the_same_wrapper():
    factory = with_tools(with_tools(Echo, ["calculator"], 100, DATA), ["my_tools.py:reverse"],
                         100, DATA / "tools")
    env = factory()
    assert isinstance(env.inner, Echo)
    assert [s["function"]["name"] for s in env.tool_schemas] == ["calculator", "reverse"]


# ---------------------------------------------------------------------------- rendering


def test_text_protocol_lists_tools_and_turns_tool_results_into_user_messages():
    env = wrapped(["calculator"])
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "c"},
               {"role": "tool", "name": "calculator", "content": "84"}]
    msgs, tools = for_template(history, env.tool_schemas, template_tools=False)
    assert tools is None
    assert msgs[0]["role"] == "system" and "- calculator(expression: string)" in \
        msgs[0]["content"] and "<tool_call>" in msgs[0]["content"]
    assert msgs[-1] == {"role": "user", "content": "<tool_response>\n84\n</tool_response>"}
    with_system = to_text_protocol([{"role": "system", "content": "Be brief."}, *history],
                                   env.tool_schemas)
    assert with_system[0]["content"].startswith("Be brief.\n\nYou can call tools.")
    assert len(with_system) == 4
    assert for_template(history, [], template_tools=False) == (history, None)


def test_a_template_that_declares_tools_renders_the_schemas_and_tool_messages(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert not template_declares_tools(tok.chat_template)
    tok.chat_template = (DATA / "templates" / "chatml_tools.jinja").read_text()
    assert template_declares_tools(tok.chat_template)
    env = wrapped(["calculator"])
    history = [{"role": "user", "content": "q"},
               {"role": "assistant", "content": call("calculator", expression="1+1")},
               {"role": "tool", "name": "calculator", "content": "2"}]
    msgs, tools = for_template(history, env.tool_schemas, template_tools=True)
    assert msgs is history and tools == env.tool_schemas
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert json.dumps(env.tool_schemas[0]) in text
    assert "<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>" in text
    # The render with the tool message only extends the render without it.
    shorter = tok.apply_chat_template(history[:2], tools=tools, tokenize=False)
    assert text.startswith(shorter)


# ---------------------------------------------------------------------------- the lookup task


def lookup_factory(**params):
    cfg = EnvironmentConfig(kind="lookup", params=params)
    return build_factory(cfg, KindContext(split="train", config_dir=Path("."), seed=0))


def test_lookup_task_rewards_the_looked_up_code_only():
    env = lookup_factory(entries=4, digits=4)()
    [opening] = env.reset(7)
    assert opening["role"] == "user" and "lookup" in opening["content"]
    target = env.inner.target
    code = env.step(call("lookup", key=target.upper())).messages[0]["content"]
    assert code.isdigit() and len(code) == 4
    assert "no entry" in env.step(call("lookup", key="zzz")).messages[0]["content"]
    assert env.step(f"The code is <answer>{code}</answer>").reward == 1.0
    env.reset(7)
    assert env.step("<answer>0</answer>").reward == 0.0
    env.reset(7)
    assert env.step(f"it is {code}").reward == 1.0


def test_lookup_episodes_are_deterministic_in_the_seed():
    a, b = lookup_factory()(), lookup_factory()()
    assert a.reset(3) == b.reset(3) and a.inner.table == b.inner.table
    assert any(lookup_factory()().reset(s) != a.reset(3) for s in range(4, 8))


def test_lookup_format_reward_credits_a_tool_call_once_not_the_success():
    plain, shaped = lookup_factory()(), lookup_factory(format_reward=0.3)()
    for env in (plain, shaped):
        env.reset(5)
        assert env.close() == 0.0  # no call yet
    target = shaped.inner.target
    for _ in range(2):  # two calls: the credit is once per episode
        assert shaped.step(call("lookup", key=target)).reward == 0.0
    assert shaped.close() == 0.3 and plain.close() == 0.0
    answer = shaped.step("<answer>0</answer>")
    assert (answer.reward, answer.metrics) == (0.0, {"correct": 0.0, "looked_up": 1.0})
    assert plain.step("<answer>0</answer>").metrics["looked_up"] == 0.0
    shaped.reset(6)
    assert shaped.close() == 0.0  # a new episode starts without the credit
    assert shaped.step(call("lookup", id="x")).messages[0]["content"].startswith("error")
    assert shaped.close() == 0.0  # a call that could not run earns nothing


def test_lookup_examples_are_solved_episodes_with_other_names():
    plain, shown = lookup_factory()(), lookup_factory(examples=2)()
    question = plain.reset(4)
    messages = shown.reset(4)
    assert messages[-1:] == question and shown.inner.table == plain.inner.table
    assert [m["role"] for m in messages[:-1]] == ["user", "assistant", "tool", "assistant"] * 2
    for ask, call_, result, answer in (messages[0:4], messages[4:8]):
        name = re.search(r"code of (\w+)\?", ask["content"]).group(1)
        assert name not in plain.inner.table
        assert call_["content"] == call("lookup", key=name)
        assert answer["content"] == f"<answer>{result['content']}</answer>"
    assert shown.reset(4) == messages  # deterministic in the seed
    with pytest.raises(UserError, match="examples = 26: use 0 to 25"):
        lookup_factory(entries=5, examples=26)


def test_lookup_with_extra_tools_and_bad_params():
    cfg = EnvironmentConfig(kind="lookup", tools=["calculator"])
    env = build_factory(cfg, KindContext(split="train", config_dir=Path("."), seed=0))()
    assert [s["function"]["name"] for s in env.tool_schemas] == ["lookup", "calculator"]
    with pytest.raises(UserError, match="lookup has no size"):
        lookup_factory(size=3)
    with pytest.raises(UserError, match="entries = 0"):
        lookup_factory(entries=0)
    with pytest.raises(UserError, match="whole number"):
        lookup_factory(digits="3")
    with pytest.raises(UserError, match="format_reward = 2: use 0 to 1"):
        lookup_factory(format_reward=2)
    with pytest.raises(UserError, match="format_reward = 'x': use a number"):
        lookup_factory(format_reward="x")

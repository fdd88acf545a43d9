"""Two verifiers environments in the classic API, for tests/environments/test_env_verifiers.py:
`load_environment(kind="guess")` a MultiTurnEnv (guess a number, "higher"/"lower" hints),
`load_environment(kind="tools")` a ToolEnv (add two numbers with a tool, then answer),
`load_environment(kind="single")` a SingleTurnEnv (say a number)."""

from __future__ import annotations

import time

import verifiers as vf
from datasets import Dataset


class GuessEnv(vf.MultiTurnEnv):
    async def setup_state(self, state: vf.State) -> vf.State:
        state["target"] = int(state["answer"])
        return state

    async def env_response(self, messages: vf.Messages, state: vf.State,
                           **kwargs) -> vf.Messages:
        text = messages[-1].content or ""
        digits = "".join(ch for ch in text if ch.isdigit())
        guess = int(digits) if digits else -1
        if guess == state["target"]:
            state["solved"] = True
            state["final_env_response"] = [vf.UserMessage(content="correct")]
            return state["final_env_response"]
        return [vf.UserMessage(content="higher" if guess < state["target"] else "lower")]


def solved(state: vf.State) -> float:
    return 1.0 if state.get("solved") else 0.0


def fewer_turns(state: vf.State) -> float:
    return 1.0 / max(1, len(state["trajectory"]))


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a + b


def nap(seconds: float) -> str:
    """Sleep for a while.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "rested"


def shout(size: int) -> str:
    """Return a long text.

    Args:
        size: how many characters.
    """
    return "A" * size


def right_sum(completion: vf.Messages, answer: str) -> float:
    last = completion[-1].content if completion else ""
    return 1.0 if last and answer in last else 0.0


def load_environment(kind: str = "guess", rows: int = 8, max_turns: int = 4) -> vf.Environment:
    if kind == "guess":
        data = Dataset.from_list([{"question": "Guess my number between 1 and 9.",
                                   "answer": str(1 + i % 9)} for i in range(rows)])
        rubric = vf.Rubric(funcs=[solved, fewer_turns], weights=[1.0, 0.1])
        return GuessEnv(dataset=data, rubric=rubric, max_turns=max_turns)
    if kind == "single":
        data = Dataset.from_list([{"question": f"Say {i}.", "answer": str(i)}
                                  for i in range(rows)])
        return vf.SingleTurnEnv(dataset=data, rubric=vf.Rubric(funcs=[right_sum]))
    data = Dataset.from_list([{"question": f"What is {i} + {2 * i}? Use the add tool.",
                               "answer": str(3 * i)} for i in range(rows)])
    return vf.ToolEnv(dataset=data, tools=[add, nap, shout], max_turns=max_turns,
                      rubric=vf.Rubric(funcs=[right_sum]))

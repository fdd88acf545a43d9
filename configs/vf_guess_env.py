"""A verifiers environment in the classic API, for configs/env-verifiers.toml: guess a number
from 1 to 9 with "higher"/"lower" hints; the rubric rewards solving it, sooner is better.
retrain imports it by name (environment.id = "vf_guess_env") from the config's folder."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


class GuessEnv(vf.MultiTurnEnv):
    async def setup_state(self, state: vf.State) -> vf.State:
        state["target"] = int(state["answer"])
        return state

    async def env_response(self, messages: vf.Messages, state: vf.State,
                           **kwargs) -> vf.Messages:
        digits = "".join(ch for ch in (messages[-1].content or "") if ch.isdigit())
        guess = int(digits[:3]) if digits else 0
        if guess == state["target"]:
            state["solved"] = True
            state["final_env_response"] = [vf.UserMessage(content="correct")]
            return state["final_env_response"]
        return [vf.UserMessage(content="higher" if guess < state["target"] else "lower")]


def solved(state: vf.State) -> float:
    return 1.0 if state.get("solved") else 0.0


def fewer_turns(state: vf.State) -> float:
    return 1.0 / max(1, len(state["trajectory"]))


def load_environment(rows: int = 32, max_turns: int = 4) -> vf.Environment:
    data = Dataset.from_list([{"question": "Guess my number from 1 to 9. Reply with a number.",
                               "answer": str(1 + i % 9)} for i in range(rows)])
    return GuessEnv(dataset=data, rubric=vf.Rubric(funcs=[solved, fewer_turns],
                                                   weights=[1.0, 0.1]),
                    max_turns=max_turns)

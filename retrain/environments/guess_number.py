"""The `guess_number` kind: a built-in multi-turn game with higher/lower feedback.

The environment thinks of a whole number between `low` and `high` (from the episode's seed);
the model guesses, the environment answers "higher" or "lower", until the model hits it or
the turns run out. Reward: 1 for finding it (less `turn_penalty` for each wrong guess
before it), 0 otherwise, plus `format_reward` for each reply that holds a number in range
(0 by default; a small value teaches a small model the answer format first). The first whole
number in a reply is the guess; a reply without one is told how to answer and counts as a
turn. Pure: no I/O.

    [environment]
    kind = "guess_number"
    max_turns = 6
    [environment.params]
    low = 1
    high = 16
"""

from __future__ import annotations

import random
import re

from retrain.config.sections import EnvironmentConfig
from retrain.environments.kinds import Factory, KindContext
from retrain.environments.protocol import Environment, Message, Step
from retrain.errors import UserError

_NUMBER = re.compile(r"-?\d+")


class GuessNumber(Environment):
    def __init__(self, low: int = 1, high: int = 16, turn_penalty: float = 0.0,
                 format_reward: float = 0.0):
        if not isinstance(low, int) or not isinstance(high, int) or low >= high:
            raise ValueError(f"low = {low!r} and high = {high!r}: need whole numbers, low < high")
        self.low, self.high, self.turn_penalty = low, high, float(turn_penalty)
        self.format_reward = float(format_reward)
        self.secret = low
        self.wrong = 0

    def reset(self, seed: int) -> list[Message]:
        self.secret = random.Random(seed).randint(self.low, self.high)
        self.wrong = 0
        return [{"role": "user", "content":
                 f"I am thinking of a whole number between {self.low} and {self.high}. "
                 "Guess it. Reply with just the number; I will say higher or lower."}]

    def step(self, reply: str) -> Step:
        found = _NUMBER.search(reply)
        if found is None:
            self.wrong += 1
            return _say(f"Reply with one whole number between {self.low} and {self.high}.",
                        valid=0.0)
        guess = int(found.group())
        shaped = self.format_reward if self.low <= guess <= self.high else 0.0
        if guess == self.secret:
            reward = max(0.0, 1.0 - self.turn_penalty * self.wrong)
            return Step(messages=[], reward=reward + shaped, done=True,
                        metrics={"valid_guess": 1.0, "correct": 1.0})
        self.wrong += 1
        step = _say("Higher." if guess < self.secret else "Lower.", valid=1.0)
        step.reward = shaped
        return step


def _say(text: str, valid: float) -> Step:
    return Step(messages=[{"role": "user", "content": text}],
                metrics={"valid_guess": valid, "correct": 0.0})


def build(cfg: EnvironmentConfig, ctx: KindContext) -> Factory:
    params = dict(cfg.params)
    try:
        GuessNumber(**params)
    except (TypeError, ValueError) as exc:
        raise UserError(f"[environment.params] for kind 'guess_number': {exc} (keys: low, "
                        "high, turn_penalty, format_reward)") from None
    return lambda: GuessNumber(**params)

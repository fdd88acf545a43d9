"""The Environment protocol: text in, text out, one instance per episode.

An environment opens an episode with messages (`reset`), answers each model reply with more
messages and a reward (`step`), and may add a final reward when the episode ends (`close`).
The episode's reward is the sum of its step rewards plus `close()`. All episodes of a group
share `seed`, so their differences come from the model alone.

    from retrain.environments import Environment, Step

    class GuessMyNumber(Environment):
        def __init__(self, low: int = 1, high: int = 100):   # [environment.params]
            self.low, self.high = low, high

        def reset(self, seed: int) -> list[dict]:
            self.secret = random.Random(seed).randint(self.low, self.high)
            return [{"role": "user", "content": f"Guess my number ({self.low}-{self.high})."}]

        def step(self, reply: str) -> Step:
            ...
            return Step(messages=[{"role": "user", "content": "higher"}], reward=0.0)

Pure: no torch, no I/O. The rollout (retrain/environments/rollout.py) owns the tokens; an
environment never sees token ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Message = dict[str, str]   # {"role": "user" | "assistant" | "system" | "tool", "content": ...}


@dataclass
class Step:
    """What the environment answers to one model reply."""

    messages: list[Message] = field(default_factory=list)  # shown to the model next (mask 0)
    reward: float = 0.0
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)  # averaged into the step's row


class Environment:
    """One episode. Subclass it and implement `reset` and `step`; `close` is optional."""

    def reset(self, seed: int) -> list[Message]:
        """The opening messages of an episode (at least one), deterministic in `seed`."""
        raise NotImplementedError

    def step(self, reply: str) -> Step:
        """React to the model's reply (its text, special tokens removed)."""
        raise NotImplementedError

    def close(self) -> float:
        """A final reward once the episode is over (textarena-style games); 0 by default."""
        return 0.0

"""A custom environment for retrain: count down, one number per turn.

retrain builds one instance per episode (with the keys of [environment.params] as keyword
arguments), calls reset(seed) for the opening messages, then step(reply) after each model
reply, until step says done or environment.max_turns replies were made. The episode's reward
is the sum of its step rewards plus close(). Keep it deterministic in `seed`: all episodes of
a group share it, and a resumed run replays the same episodes.

It runs in a worker process: print() goes to stderr, and a step that raises or takes longer
than environment.step_timeout_s ends its episode (counted in the env_errors metric).
"""

import random

from retrain.environments import Environment, Step


class CountDown(Environment):
    def __init__(self, start_min: int = 3, start_max: int = 6):
        self.start_min, self.start_max = start_min, start_max

    def reset(self, seed: int) -> list[dict]:
        # The episode's starting number comes from its seed (the same for the whole group).
        self.start = random.Random(seed).randint(self.start_min, self.start_max)
        self.expected = self.start - 1
        return [{"role": "user", "content": f"Let's count down from {self.start} to 0, one "
                 f"number per reply. I say {self.start}. Your turn: reply with just the "
                 "next number."}]

    def step(self, reply: str) -> Step:
        words = reply.strip().split()
        said = words[0].strip(".,!") if words else ""
        if said != str(self.expected):
            # A wrong number ends the episode; the reward so far stays.
            return Step(done=True, metrics={"reached": self.start - self.expected})
        reward = 1.0 / self.start  # a full count down is worth 1 in total
        if self.expected == 0:
            return Step(reward=reward, done=True, metrics={"reached": self.start})
        self.expected -= 1
        # Messages the model sees next (masked out of training: only its replies are trained).
        return Step(messages=[{"role": "user", "content": "Next."}], reward=reward)

    def close(self) -> float:
        # An optional final reward once the episode is over (0 here).
        return 0.0

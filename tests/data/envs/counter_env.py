"""A user environment for the tests: count up to `target`, one number per turn."""

from retrain.environments import Environment, Step


class CountTo(Environment):
    def __init__(self, target: int = 3):
        self.target = target

    def reset(self, seed: int):
        self.next = 1
        return [{"role": "user", "content": f"Count from 1 to {self.target}, one number per "
                 f"reply. Start. (seed {seed})"}]

    def step(self, reply: str) -> Step:
        ok = reply.strip().startswith(str(self.next))
        self.next += 1
        done = self.next > self.target
        return Step(messages=[] if done else [{"role": "user", "content": "next"}],
                    reward=1.0 if ok else 0.0, done=done)


def make_count_to(target: int = 3) -> CountTo:
    return CountTo(target)


NOT_AN_ENV = 5


def not_an_env():
    return object()

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


class Digits(Environment):
    """Three turns; each reply earns the fraction of its characters that are digits."""

    def __init__(self, turns: int = 3):
        self.turns = turns

    def reset(self, seed: int):
        self.left = self.turns
        return [{"role": "user", "content": f"Write digits. ({seed % 97})"}]

    def step(self, reply: str) -> Step:
        self.left -= 1
        reward = sum(c.isdigit() for c in reply) / len(reply) if reply else 0.0
        return Step(messages=[{"role": "user", "content": f"{self.left} more"}],
                    reward=reward / self.turns, done=self.left == 0,
                    metrics={"digit_share": reward})


class Raises(Environment):
    """Raises in step on the second turn."""

    def reset(self, seed: int):
        self.turn = 0
        return [{"role": "user", "content": "hi"}]

    def step(self, reply: str) -> Step:
        self.turn += 1
        if self.turn == 2:
            raise RuntimeError("the environment broke")
        return Step(messages=[{"role": "user", "content": "again"}], reward=0.5)


class Hangs(Environment):
    """Hangs in step when the seed is odd (sleeps far past any timeout)."""

    def reset(self, seed: int):
        self.seed = seed
        return [{"role": "user", "content": "hi"}]

    def step(self, reply: str) -> Step:
        if self.seed % 2:
            import time

            time.sleep(1000)
        return Step(reward=1.0, done=True)


class NeverDone(Environment):
    def reset(self, seed: int):
        return [{"role": "user", "content": "talk"}]

    def step(self, reply: str) -> Step:
        return Step(messages=[{"role": "user", "content": "more"}], reward=0.1)

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

    def __init__(self, turns: int = 3, kill_parent_on_step: int = 0):
        self.turns, self.kill_on = turns, kill_parent_on_step

    def reset(self, seed: int):
        self.left = self.turns
        return [{"role": "user", "content": f"Write digits. ({seed % 97})"}]

    def step(self, reply: str) -> Step:
        if self.kill_on:
            _kill_parent_once(self.kill_on)
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
    """Hangs in step when the seed is odd or `always` (sleeps far past any timeout)."""

    def __init__(self, always: bool = False):
        self.always = always

    def reset(self, seed: int):
        self.seed = seed
        return [{"role": "user", "content": "hi"}]

    def step(self, reply: str) -> Step:
        if self.always or self.seed % 2:
            import time

            time.sleep(1000)
        return Step(reward=1.0, done=True)


class NeverDone(Environment):
    def reset(self, seed: int):
        return [{"role": "user", "content": "talk"}]

    def step(self, reply: str) -> Step:
        return Step(messages=[{"role": "user", "content": "more"}], reward=0.1)


def _kill_parent_once(on_call: int) -> None:
    """SIGKILL the trainer (this worker's parent) at the on_call-th step() of the run, once:
    a marker file next to this module counts the calls and remembers the kill."""
    import os
    import signal
    from pathlib import Path

    marker = Path(__file__).with_name("kill_marker.txt")
    calls = int(marker.read_text()) if marker.exists() else 0
    if calls < 0:
        return  # already killed once: the resumed run goes on
    calls += 1
    marker.write_text(str(-1 if calls >= on_call else calls))
    if calls >= on_call:
        os.kill(os.getppid(), signal.SIGKILL)


class Stateful(Environment):
    """Rewards its own turn number; an odd seed hangs on turn 2; seed 4 returns junk."""

    def reset(self, seed: int):
        self.seed, self.turn = seed, 0
        return [{"role": "user", "content": f"go {seed}"}]

    def step(self, reply: str):
        self.turn += 1
        if self.seed == 4:
            return {"reward": 1}
        if self.seed % 2 and self.turn == 2:
            import time

            time.sleep(1000)
        return Step(messages=[{"role": "user", "content": f"turn {self.turn}"}],
                    reward=float(self.turn))


class Listing(Environment):
    """Shows file names as os.listdir() gives them: a latin-1 name has a lone surrogate."""

    NAME = b"caf\xe9.txt".decode("utf-8", "surrogateescape")  # what os.listdir() returns

    def reset(self, seed: int):
        return [{"role": "user", "content": f"Files: {self.NAME}"}]

    def step(self, reply: str) -> Step:
        return Step(messages=[{"role": "tool", "name": "ls", "content": self.NAME}],
                    reward=1.0, done=reply.strip().startswith("3"))


class EvenLength(Environment):
    """One turn, a success when the reply has an even number of characters: about half of a
    random model's replies, so mean@k and pass@k of its samples lie strictly inside (0, 1)."""

    def reset(self, seed: int):
        return [{"role": "user", "content": f"Say something. (seed {seed})"}]

    def step(self, reply: str) -> Step:
        return Step(reward=1.0 if len(reply) % 2 == 0 else 0.0, done=True)


class Fingerprint(Environment):
    """`turns` turns, each reply scored by a checksum of its text in (0, 1]: two checkpoints
    that reply differently score differently, and no reply scores 0, whatever the model
    writes (a random model's replies may hold no digit at all)."""

    def __init__(self, turns: int = 2):
        self.turns = turns

    def reset(self, seed: int):
        self.left = self.turns
        return [{"role": "user", "content": f"Write anything. (seed {seed})"}]

    def step(self, reply: str) -> Step:
        import zlib

        self.left -= 1
        score = (zlib.crc32(reply.encode("utf-8")) % 997 + 1) / 997
        return Step(messages=[{"role": "user", "content": f"{self.left} more"}],
                    reward=score / self.turns, done=self.left == 0)

"""User tools for tests/environments/test_env_tools.py, named as 'my_tools.py:function'."""

import time


def reverse(text: str) -> str:
    """Reverse a piece of text.

    Args:
        text: what to reverse.
    """
    return text[::-1]


def sleepy(seconds: float = 1000.0) -> str:
    """Sleep a long time (a tool that hangs)."""
    time.sleep(seconds)
    return "awake"


def chatty(megabytes: int = 10) -> str:
    """Print a lot (a tool that floods its output)."""
    print("x" * (megabytes * 1024 * 1024))
    return "done"


async def later(text: str) -> str:
    """Reverse a piece of text, asynchronously (an `async def` tool is awaited)."""
    import asyncio

    await asyncio.sleep(0)
    return text[::-1]


def count_up(n: int):
    """A generator: not a tool (it would answer with its repr)."""
    yield from range(n)


class Reverser:
    """A class: not a tool (calling it makes an instance)."""

    def __init__(self, text: str):
        self.text = text

"""The built-in tool task, `kind = "lookup"`: look a value up with a tool and report it.

Each episode hides a small table of names and codes behind the `lookup` tool and asks for
one name's code. The code is random, so the only way to the reward is to call the tool and
copy its answer: reward 1 when the reply's answer (inside <answer></answer>, else its last
number) is the code, 0 otherwise. Small enough for SmolLM2-135M to learn on a CPU.
`format_reward` (0 by default) is added once per episode in which the model called the tool
and the call ran: shaping for a small model that answers at once without it (the
`looked_up` metric, on the answering step, counts such episodes; `correct`, and so the
success rate, is unchanged).
`examples` (0 by default) shows that many solved episodes first (question, call, result,
answer; names not in the episode's table), a few-shot prompt.

    [environment]
    kind = "lookup"
    max_turns = 3
    params = {entries = 5, digits = 3, format_reward = 0.0}
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

from retrain.config.sections import EnvironmentConfig
from retrain.environments.kinds import KindContext
from retrain.environments.protocol import Environment, Message, Step
from retrain.environments.tools.render import tool_message
from retrain.environments.tools.wrapper import ToolEnvironment
from retrain.errors import UserError

NAMES = ("apple", "river", "tiger", "cloud", "stone", "maple", "ocean", "pepper", "violet",
         "falcon", "copper", "lemon", "harbor", "cedar", "ember", "willow", "comet", "badger",
         "meadow", "quartz", "saffron", "walnut", "glacier", "orchid", "lantern", "pebble",
         "thistle", "cobalt", "juniper", "marble")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"\d+")


class LookupTask(Environment):
    """One episode: find the code of one name with the `lookup` tool."""

    def __init__(self, entries: int = 5, digits: int = 3, format_reward: float = 0.0,
                 examples: int = 0):
        if not 1 <= entries <= len(NAMES):
            raise UserError(f"environment.params.entries = {entries}: use 1 to {len(NAMES)}")
        if not 0 <= examples <= len(NAMES) - entries:
            raise UserError(f"environment.params.examples = {examples}: use 0 to "
                            f"{len(NAMES) - entries} (names not in the table)")
        if not 1 <= digits <= 9:
            raise UserError(f"environment.params.digits = {digits}: use 1 to 9")
        if not 0.0 <= format_reward <= 1.0:
            raise UserError(f"environment.params.format_reward = {format_reward}: use 0 to 1")
        self.entries, self.digits, self.format_reward = entries, digits, float(format_reward)
        self.examples = examples
        self.table: dict[str, str] = {}
        self.target = ""
        self.looked_up = False
        self.tools = [self.lookup]

    def reset(self, seed: int) -> list[Message]:
        rng = random.Random(seed)
        names = rng.sample(NAMES, self.entries)
        low = 10 ** (self.digits - 1) if self.digits > 1 else 0
        self.table = {n: str(rng.randint(low, 10 ** self.digits - 1)) for n in names}
        self.target = rng.choice(names)
        self.looked_up = False
        others = rng.sample([n for n in NAMES if n not in self.table], self.examples)
        codes = [str(rng.randint(low, 10 ** self.digits - 1)) for _ in others]
        shown = [m for n, code in zip(others, codes, strict=True) for m in _solved(n, code)]
        return [*shown, _question(self.target)]

    def lookup(self, key: str) -> str:
        """Look up the code stored under a name.

        Args:
            key: the name to look up.
        """
        self.looked_up = True
        code = self.table.get(str(key).strip().lower())
        if code is None:
            return f"no entry named {key!r}"
        return code

    def step(self, reply: str) -> Step:
        found = _ANSWER.findall(reply)
        numbers = _NUMBER.findall(found[-1] if found else reply)
        solved = bool(numbers) and numbers[-1] == self.table.get(self.target)
        return Step(reward=float(solved), done=True,
                    metrics={"correct": float(solved), "looked_up": float(self.looked_up)})

    def close(self) -> float:
        """The shaping credit: `format_reward` when the tool ran in this episode."""
        return self.format_reward if self.looked_up else 0.0


def _question(name: str) -> Message:
    return {"role": "user", "content": (
        f"What is the code of {name}? Find it with the lookup tool: {_call(name)}\n"
        "Then reply with the code as <answer>CODE</answer>.")}


def _call(name: str) -> str:
    return f'<tool_call>{{"name": "lookup", "arguments": {{"key": "{name}"}}}}</tool_call>'


def _solved(name: str, code: str) -> list[Message]:
    """One example episode, solved: the question, the call, its result and the answer."""
    return [_question(name), {"role": "assistant", "content": _call(name)},
            tool_message("lookup", code),
            {"role": "assistant", "content": f"<answer>{code}</answer>"}]


def build(cfg: EnvironmentConfig, ctx: KindContext) -> Callable[[], Environment]:
    """The `lookup` kind: episodes of LookupTask with its own tool."""
    params = dict(cfg.params)
    unknown = sorted(set(params) - {"entries", "digits", "format_reward", "examples"})
    if unknown:
        raise UserError(f"environment.params: lookup has no {', '.join(unknown)}; "
                        "it takes entries (names in the table), digits (of each code), "
                        "format_reward (shaping for calling the tool) and examples (solved "
                        "episodes shown first)")
    for key, value in params.items():
        if key == "format_reward":
            if type(value) not in (int, float):
                raise UserError(f"environment.params.format_reward = {value!r}: use a number "
                                "from 0 to 1")
        elif type(value) is not int:
            raise UserError(f"environment.params.{key} = {value!r}: use a whole number")
    LookupTask(**params)  # bad values fail here, in the parent, not in every episode
    max_chars = cfg.tool_max_chars

    def make() -> Environment:
        return ToolEnvironment(LookupTask(**params), [], max_chars)

    return make

"""Tools for any environment: `with_tools(factory, ["calculator", "tools.py:lookup"], ...)`.

The wrapped Environment answers a reply that calls tools itself: it runs each call and
returns the results as tool messages (reward 0, not done), so the model can read them on its
next turn. A reply without a tool call goes to the wrapped environment as usual. Errors (an
unknown tool, bad arguments, a tool that raises) go back to the model as text; what a tool
prints is captured (never reaches the worker's stdout) and its output is cut to
`tool_max_chars`. A tool runs inside `step`, so the rollout's `step_timeout_s` covers it; an
`async def` tool is awaited there (its own event loop per call). Classes, generator functions
and two tools of one name are refused at start-up.

An environment may also bring its own tools (bound methods that see its episode state):
list them in `self.tools`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from retrain.environments.protocol import Environment, Message, Step
from retrain.environments.tools.builtin import BUILTIN_TOOLS
from retrain.environments.tools.calls import ToolCall, parse_tool_calls
from retrain.environments.tools.render import tool_message
from retrain.environments.tools.schema import function_schema
from retrain.errors import UserError

Tool = Callable[..., Any]
Factory = Callable[[], Environment]
MAX_CALLS_PER_REPLY = 8


def with_tools(factory: Factory, tools: list[str], max_chars: int,
               config_dir: Path) -> Factory:
    """A factory of the same episodes with `tools` added (built-in names or
    'file.py:function' / 'module:function', relative to `config_dir`)."""
    loaded = load_tools(tools, Path(config_dir))

    def make() -> Environment:
        env = factory()
        if isinstance(env, ToolEnvironment):
            env.add_tools(loaded)
            env.max_chars = max_chars
            return env
        return ToolEnvironment(env, loaded, max_chars)

    return make


def load_tools(specs: list[str], config_dir: Path) -> list[Tool]:
    """The tool functions named in `[environment] tools` (a name given twice counts once),
    checked at start-up: functions (`async def` ones are awaited) with distinct names."""
    from retrain.environments.rewards import load_custom  # its imports are not needed above

    out: dict[str, Tool] = {}
    named: dict[str, str] = {}  # tool name -> the spec that gave it
    for spec in dict.fromkeys(s.strip() for s in specs):
        if spec in BUILTIN_TOOLS:
            fn = BUILTIN_TOOLS[spec]
        elif ":" in spec:
            fn = load_custom(spec, config_dir, key="environment.tools")
        else:
            raise UserError(f"environment.tools: {spec!r} is not a built-in tool ("
                            + ", ".join(sorted(BUILTIN_TOOLS))
                            + "); name your own as 'file.py:function' or 'module:function'")
        check_tool(fn, f"environment.tools = {spec!r}")
        name = tool_name(fn)
        if name in named:
            raise UserError(f"environment.tools: {named[name]!r} and {spec!r} are both named "
                            f"{name!r} (a tool is called by its function's name); keep one")
        named[name], out[spec] = spec, fn
    return list(out.values())


def tool_name(fn: Tool) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def check_tool(fn: Tool, where: str) -> None:
    """UserError for what cannot answer a call with a value: a class (its instance's repr
    would come back) or a generator function."""
    if inspect.isclass(fn):
        raise UserError(f"{where}: {fn.__name__} is a class; a tool is a function that "
                        "returns its answer")
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise UserError(f"{where}: {tool_name(fn)} is a generator function (it yields); a "
                        "tool returns its whole answer")


class ToolEnvironment(Environment):
    """An environment whose model may call tools before it replies for real."""

    def __init__(self, inner: Environment, tools: list[Tool], max_chars: int):
        self.inner = inner
        self.max_chars = max_chars
        self.tools: dict[str, Tool] = {}
        self.tool_schemas: list[dict] = []
        self.add_tools([*getattr(inner, "tools", []), *tools])

    def add_tools(self, tools: list[Tool]) -> None:
        for fn in tools:
            name = tool_name(fn)
            check_tool(fn, f"the environment's tool {name!r}")
            if name in self.tools:
                if self.tools[name] == fn:  # the same tool named twice
                    continue
                raise UserError(f"environment.tools: two tools are named {name!r}")
            self.tools[name] = fn
            self.tool_schemas.append(function_schema(fn, name))

    def reset(self, seed: int) -> list[Message]:
        return self.inner.reset(seed)

    def step(self, reply: str) -> Step:
        calls = parse_tool_calls(reply, set(self.tools))
        if not calls:
            return self.inner.step(reply)
        messages, errors, truncated = [], 0, 0
        for call in calls[:MAX_CALLS_PER_REPLY]:
            name, content, ok, cut = self._run(call)
            messages.append(tool_message(name, content))
            errors += not ok
            truncated += cut
        metrics = {"tool_calls": float(len(messages))}
        if errors:
            metrics["tool_errors"] = float(errors)
        if truncated:
            metrics["tool_truncated"] = float(truncated)
        return Step(messages=messages, reward=0.0, done=False, metrics=metrics)

    def close(self) -> float:
        return self.inner.close()

    def _run(self, call: ToolCall) -> tuple[str, str, bool, bool]:
        """(tool name, output text, ran without error, output was cut)."""
        if call.error:
            return call.name or "error", f"error: {call.error}", False, False
        fn = self.tools.get(call.name)
        if fn is None:
            return call.name, (f"error: no tool named {call.name!r}; tools: "
                               + ", ".join(self.tools)), False, False
        printed = _CappedText(self.max_chars)
        ok = True
        try:
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                result = fn(*call.args, **call.kwargs)
                if inspect.isawaitable(result):  # an `async def` tool
                    result = asyncio.run(_awaited(result))
            text = printed.text() + _as_text(result)
        except Exception as exc:
            ok = False
            text = printed.text() + f"error: {type(exc).__name__}: {exc}"
        content, cut = truncate(text, self.max_chars, printed.dropped)
        return call.name, content, ok, cut


def truncate(text: str, max_chars: int, dropped: int = 0) -> tuple[str, bool]:
    """`text` cut to `max_chars` characters, with a note of how many more there were."""
    extra = max(0, len(text) - max_chars) + dropped
    if not extra:
        return text, False
    return text[:max_chars] + f"\n[truncated: {extra} more characters]", True


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if inspect.isgenerator(value) or inspect.isasyncgen(value):
        raise TypeError("the tool returned a generator, not its answer")
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


class _CappedText(io.TextIOBase):
    """A stdout stand-in that keeps the first `limit` characters and counts the rest."""

    def __init__(self, limit: int):
        self.limit, self.parts, self.kept, self.dropped = limit, [], 0, 0

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        room = self.limit - self.kept
        if room > 0:
            self.parts.append(s[:room])
            self.kept += min(room, len(s))
        self.dropped += max(0, len(s) - max(room, 0))
        return len(s)

    def text(self) -> str:
        return "".join(self.parts)

"""Tool calls in a model's reply: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The text protocol (docs/environments-adapters.md) and the templates that declare tools in the
Hermes/Qwen style share this format. Also accepted, for small models: a Python-style call
inside the tags, `<tool_call>lookup("apple")</tool_call>` (literal arguments only), and a
reply that is nothing but the JSON object (Llama 3 style). Pure: no I/O.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

_TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    args: list[Any] = field(default_factory=list)       # positional (Python-style calls only)
    kwargs: dict[str, Any] = field(default_factory=dict)
    error: str = ""                                      # why the call could not be read


def parse_tool_calls(reply: str, names: set[str]) -> list[ToolCall]:
    """The tool calls in `reply` (in order); [] when it makes none. A call that cannot be read
    comes back with `error` set, so the model is told what went wrong."""
    bodies = [m.group(1) for m in _TAGGED.finditer(reply)]
    if not bodies:
        whole = reply.strip()
        if whole.startswith("{") and whole.endswith("}"):
            call = _from_json(whole)
            if not call.error and call.name in names:
                return [call]
        return []
    return [_parse_body(body.strip()) for body in bodies]


def _parse_body(body: str) -> ToolCall:
    if not body:
        return ToolCall("", error="the <tool_call> is empty")
    if body.startswith("{"):
        return _from_json(body)
    return _from_python(body)


def _from_json(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall("", error=f"the tool call is not valid JSON ({exc.msg})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", error='the tool call needs a "name"')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some templates send the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCall(obj["name"], error=f"its arguments are not valid JSON ({exc.msg})")
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error='"arguments" must be an object')
    return ToolCall(obj["name"], kwargs=args)


def _from_python(body: str) -> ToolCall:
    try:
        node = ast.parse(body, mode="eval").body
    except SyntaxError:
        return ToolCall("", error='write the call as {"name": ..., "arguments": {...}}')
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return ToolCall("", error='write the call as {"name": ..., "arguments": {...}}')
    try:
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
    except (ValueError, SyntaxError, TypeError):
        return ToolCall(node.func.id, error="its arguments must be plain values "
                                            "(numbers, strings, lists)")
    return ToolCall(node.func.id, args=args, kwargs=kwargs)

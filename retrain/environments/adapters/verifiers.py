"""`kind = "verifiers"`: an installed environment of the verifiers library (classic API:
MultiTurnEnv, ToolEnv, SingleTurnEnv with a Rubric), one dataset row per episode.

    [environment]
    kind = "verifiers"
    id = "my_env"              # the installed module whose load_environment(**params) builds it
    params = {difficulty = 2}  # keyword arguments of load_environment
    max_turns = 6

How it is driven: verifiers' own `rollout()` runs unchanged (its setup_state, env_response,
stop conditions, final_env_response, timeouts, cleanup), in an event loop of this episode,
with an in-process client shim in place of a model server. When the rollout asks the client
for a model turn, `reset`/`step` hand the new messages to retrain's rollout and return; the
model's reply comes back as the next `step(reply)` and the shim answers the pending request
with it as text. So retrain's rollout keeps sampling and owns every token (the ledger stays
exact: sampled ids are never re-encoded), and verifiers only ever sees text. When the
rollout ends, the environment's Rubric scores it: its reward is the episode's reward and
its metrics are averaged into the step's row.

Tools (ToolEnv): the tools' schemas are exposed as `tool_schemas` (rendered by the chat
template where it declares tools, else by the text protocol); a reply's
<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks become the assistant
message's tool_calls, ToolEnv runs them, and their results come back as tool messages (cut to
tool_max_chars). A tool runs inside `step`, so step_timeout_s covers it; a hung tool is
killed with its worker. Group reward functions and environments that rewrite the
conversation (a get_prompt_messages that does not extend it) are not supported.
Tested with verifiers 0.2.1 (its vf.Client API; 0.1.x took an AsyncOpenAI client instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from retrain.config.sections import EnvironmentConfig
from retrain.environments.kinds import KindContext, MissingExtra
from retrain.environments.protocol import Environment, Message, Step
from retrain.environments.tools.calls import parse_tool_calls
from retrain.environments.tools.wrapper import truncate
from retrain.errors import UserError

PIP = "pip install 'retrain[verifiers]'"
MODEL_NAME = "retrain"


def build(cfg: EnvironmentConfig, ctx: KindContext) -> Callable[[], Environment]:
    """Episodes of the verifiers environment `cfg.id`, loaded once per process."""
    vf_env = load(cfg, ctx.config_dir)
    rows = _rows(vf_env, ctx.split)
    max_chars = cfg.tool_max_chars
    return lambda: VerifiersEpisode(vf_env, rows, max_chars)


def load(cfg: EnvironmentConfig, config_dir: Path) -> Any:
    """The environment `load_environment(**cfg.params)` of the module `cfg.id` returns."""
    try:
        import verifiers as vf
        from verifiers.clients import Client  # noqa: F401 (the API this adapter drives)
    except ImportError:
        raise MissingExtra("verifiers (>= 0.2, < 0.3)", PIP) from None
    if not cfg.id:
        raise UserError("environment.id: name the installed verifiers environment module, "
                        "e.g. id = 'my_env' (a module with load_environment())")
    try:
        with _on_sys_path(Path(config_dir)):
            env = vf.load_environment(cfg.id, **dict(cfg.params))
    except Exception as exc:  # verifiers wraps what went wrong: ImportError, TypeError, ...
        cause = exc.__cause__ or exc
        if isinstance(cause, ImportError):
            raise UserError(f"environment.id = {cfg.id!r}: importing it failed ({cause}); "
                            "install the environment's package (offline: from a local copy) "
                            f"or put the module next to the config file, in {config_dir}") \
                from None
        if isinstance(cause, TypeError):
            raise UserError(f"environment.params: {cfg.id}.load_environment does not take "
                            f"these settings ({cause})") from None
        raise UserError(f"environment.id = {cfg.id!r}: load_environment failed: "
                        f"{type(cause).__name__}: {cause}") from None
    if not isinstance(env, vf.MultiTurnEnv):
        raise UserError(f"environment.id = {cfg.id!r}: load_environment returned a "
                        f"{type(env).__name__}; retrain drives MultiTurnEnv (and its "
                        "subclasses SingleTurnEnv, ToolEnv)")
    return env


def _rows(env: Any, split: str) -> list[dict]:
    dataset = None
    if split == "eval":
        with contextlib.suppress(Exception):
            dataset = env.get_eval_dataset()
    if dataset is None:
        try:
            dataset = env.get_dataset()
        except Exception as exc:
            raise UserError(f"environment.id: the verifiers environment has no dataset "
                            f"({exc})") from None
    rows = [dict(row) for row in dataset]
    if not rows:
        raise UserError("environment.id: the verifiers environment's dataset is empty")
    return rows


class _Shim:
    """The client the verifiers rollout calls: each request waits for retrain's reply."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.asked: asyncio.Future = loop.create_future()
        self.reply: asyncio.Future | None = None
        self.prompt: list = []
        self.state: Any = None

    async def get_response(self, prompt: list, model: str, sampling_args: dict,
                           tools: list | None = None, **kwargs: Any) -> Any:
        self.prompt, self.state = list(prompt), kwargs.get("state", self.state)
        self.reply = self.loop.create_future()
        if not self.asked.done():
            self.asked.set_result(True)
        text, tool_calls = await self.reply
        return _response(text, tool_calls)


class VerifiersEpisode(Environment):
    """One episode: verifiers' rollout of one dataset row, its model turns sampled by us."""

    def __init__(self, vf_env: Any, rows: list[dict], max_chars: int):
        self.vf_env, self.rows, self.max_chars = vf_env, rows, max_chars
        self.loop = asyncio.new_event_loop()
        self.shim = _Shim(self.loop)
        self.task: asyncio.Task | None = None
        self.history: list = []   # the conversation so far, as verifiers messages
        self.tool_names: dict[str, str] = {}  # tool_call id -> tool name
        self.scored = False
        tool_defs = list(getattr(vf_env, "tool_defs", None) or [])
        self.tool_schemas = [_schema(t) for t in tool_defs]

    def reset(self, seed: int) -> list[Message]:
        row = dict(self.rows[seed % len(self.rows)])
        row.setdefault("example_id", seed % len(self.rows))
        client = _client(self.shim)
        self.task = self.loop.create_task(
            self.vf_env.rollout(row, client, MODEL_NAME, {}))
        if self._advance():
            raise RuntimeError("the verifiers rollout ended before the model's first turn")
        self.history = list(self.shim.prompt)
        state_tools = (self.shim.state or {}).get("tool_defs") or []
        if state_tools:
            self.tool_schemas = [_schema(t) for t in state_tools]
        return [_to_message(m, self.tool_names, self.max_chars) for m in self.history]

    def step(self, reply: str) -> Step:
        if self.task is None or self.task.done():
            raise RuntimeError("step() after the verifiers rollout ended")
        tool_calls = self._tool_calls(reply)
        sent = len(self.history)
        self.shim.reply.set_result((reply, tool_calls))
        if self._advance():
            reward, metrics = self._score()
            return Step(reward=reward, done=True, metrics=metrics)
        prompt = self.shim.prompt
        if len(prompt) < sent + 1 or not _same_roles(prompt[:sent], self.history):
            raise RuntimeError("the verifiers environment rewrote the conversation (its "
                               "get_prompt_messages does not extend it); retrain trains one "
                               "growing sequence per episode")
        new = prompt[sent + 1:]  # after the assistant message made of our reply
        self.history = list(prompt)
        return Step(messages=[_to_message(m, self.tool_names, self.max_chars) for m in new],
                    metrics={"tool_calls": float(len(tool_calls))} if tool_calls else {})

    def close(self) -> float:
        """0 when the rubric scored the episode in `step`; else (our rollout stopped it
        first: max_turns, token budget) the rubric's score of the conversation so far."""
        try:
            if self.scored or self.task is None:
                return 0.0
            self.task.cancel()
            with contextlib.suppress(BaseException):
                self.loop.run_until_complete(self.task)
            if self.shim.state is None:
                return 0.0
            with contextlib.suppress(Exception):
                self.loop.run_until_complete(self.vf_env.render_completion(self.shim.state))
            return self._score()[0]
        finally:
            self.loop.close()

    # ------------------------------------------------------------------ internals

    def _advance(self) -> bool:
        """Run the rollout until it asks for the model's next turn (False) or ends (True)."""
        self.shim.asked = self.loop.create_future()
        self.loop.run_until_complete(asyncio.wait(
            {self.shim.asked, self.task}, return_when=asyncio.FIRST_COMPLETED))
        if self.task.done():
            state = self.task.result()  # re-raises what the rollout raised
            self.shim.state = state
            return True
        return False

    def _score(self) -> tuple[float, dict[str, float]]:
        state = self.shim.state
        self.loop.run_until_complete(self.vf_env.rubric.score_rollout(state))
        with contextlib.suppress(Exception):
            self.loop.run_until_complete(self.vf_env.rubric.cleanup(state))
        self.scored = True
        metrics = {k: float(v) for k, v in (state.get("metrics") or {}).items()
                   if isinstance(v, int | float) and not isinstance(v, bool)}
        if state.get("error") is not None:
            metrics["verifiers_errors"] = 1.0
        return float(state.get("reward") or 0.0), metrics

    def _tool_calls(self, reply: str) -> list[dict] | None:
        if not self.tool_schemas:
            return None
        params = {s["function"]["name"]: list(s["function"]["parameters"].get("properties", {}))
                  for s in self.tool_schemas}
        calls = []
        for call in parse_tool_calls(reply, set(params)):
            kwargs = dict(zip(params.get(call.name, []), call.args, strict=False))
            kwargs.update(call.kwargs)
            call_id = f"call_{uuid.uuid4().hex[:12]}"
            self.tool_names[call_id] = call.name
            arguments = "{" if call.error else json.dumps(kwargs)  # ToolEnv reports bad JSON
            calls.append({"id": call_id, "name": call.name or "unknown",
                          "arguments": arguments})
        return calls or None


def _client(shim: _Shim) -> Any:
    """A vf.Client whose get_response is the shim's (no model server, no network)."""
    from verifiers.clients import Client

    class ShimClient(Client):
        def setup_client(self, config: Any) -> Any:
            return None

        async def to_native_tool(self, tool: Any) -> Any:
            return tool

        async def to_native_prompt(self, messages: Any) -> tuple[Any, dict]:
            return messages, {}

        async def get_native_response(self, prompt: Any, model: str, sampling_args: Any,
                                      tools: Any = None, **kwargs: Any) -> Any:
            raise NotImplementedError

        async def raise_from_native_response(self, response: Any) -> None:
            return None

        async def from_native_response(self, response: Any) -> Any:
            return response

        async def close(self) -> None:
            return None

        async def get_response(self, prompt: Any, model: str, sampling_args: Any,
                               tools: Any = None, **kwargs: Any) -> Any:
            return await shim.get_response(prompt, model, sampling_args, tools, **kwargs)

    return ShimClient(None)


def _response(text: str, tool_calls: list[dict] | None) -> Any:
    from verifiers.types import Response, ResponseMessage, ToolCall

    message = ResponseMessage(
        content=text, tool_calls=[ToolCall(**c) for c in tool_calls] if tool_calls else None,
        finish_reason="tool_calls" if tool_calls else "stop", is_truncated=False)
    return Response(id=f"retrain-{uuid.uuid4().hex[:12]}", created=int(time.time()),
                    model=MODEL_NAME, message=message)


def _schema(tool: Any) -> dict:
    get = tool.get if hasattr(tool, "get") else lambda k, d=None: getattr(tool, k, d)
    return {"type": "function",
            "function": {"name": get("name"), "description": get("description", "") or "",
                         "parameters": get("parameters", {}) or {}}}


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        text = part.get("text") if hasattr(part, "get") else getattr(part, "text", None)
        if text:
            parts.append(text)
    return "".join(parts)


def _to_message(message: Any, tool_names: dict[str, str], max_chars: int) -> Message:
    role = message.get("role") if hasattr(message, "get") else message.role
    content = _text(message.get("content") if hasattr(message, "get") else message.content)
    if role == "tool":
        call_id = message.get("tool_call_id", "") if hasattr(message, "get") else ""
        content, _ = truncate(content, max_chars)
        return {"role": "tool", "name": tool_names.get(call_id, "tool"), "content": content}
    return {"role": str(role), "content": content}


def _same_roles(a: list, b: list) -> bool:
    role = (lambda m: m.get("role") if hasattr(m, "get") else m.role)  # noqa: E731
    return len(a) == len(b) and all(role(x) == role(y) for x, y in zip(a, b, strict=True))


@contextlib.contextmanager
def _on_sys_path(folder: Path) -> Iterator[None]:
    added = str(folder) not in sys.path
    if added:
        sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(str(folder))

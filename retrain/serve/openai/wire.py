"""OpenAI request bodies -> one checked `Call`: the chat and completions bodies parsed,
every field checked once (a 400 naming the field, in OpenAI's error shape), sampling knobs
as the backend contract's `SamplingParams`.

Fields OpenAI has that change what is sampled but retrain serve does not compute (penalties,
logit bias, tools, echo, ...) are refused when set, never ignored. Pure: no torch, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pydantic

from retrain.backends.base import SamplingParams
from retrain.serve.door.validate import MAX_SEED

MAX_N = 128            # choices per request, OpenAI's own limit
MAX_TOP_LOGPROBS = 20  # alternatives per token, OpenAI's chat limit
MAX_STOPS = 16
MAX_PROMPTS = 256      # prompts in one completions request
MAX_CHOICES = 512      # prompts x n in one completions request
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

# Fields that would change the result: refused unless absent or at their no-op value.
REFUSED: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "logit_bias": (None, {}),
    "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
    "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
    "echo": (None, False), "suffix": (None, ""), "top_k": (None, -1, 0),  # echo: chat's
    "min_tokens": (None, 0), "audio": (None,), "prediction": (None,),
    "modalities": (None, ["text"]),
}
HINTS = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of such lists",
    "stop": "a string or a list of strings",
    "messages": "a list of {role, content} objects",
}


class OpenAIError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = \
            status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


class StreamOptions(pydantic.BaseModel):
    # strict like the body: "yes" is no `include_usage` (a 400 naming it, never a guess)
    model_config = pydantic.ConfigDict(extra="allow", strict=True)

    include_usage: bool | None = None


class _Common(pydantic.BaseModel):
    # strict: "3", true or 3.0 are no `n`, "yes" is no `stream` and [true] no token ids (a
    # 400 naming the field, never a guess); a JSON integer is still a float.
    model_config = pydantic.ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    best_of: int | None = None


class ChatBody(_Common):
    messages: list[dict]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionBody(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None


@dataclass(frozen=True)
class Call:
    """One checked request. `max_tokens` None: the rest of the model's context; `prompts`:
    text or token ids, one per prompt (chat: rendered later from `messages`)."""

    model: str
    n: int
    params: SamplingParams
    max_tokens: int | None
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool
    echo: bool = False  # completions: the prompt, its log-probs too, before each choice's own
    # (with max_tokens 0: the prompt alone, scored; nothing is sampled)
    messages: list[dict] = field(default_factory=list)
    prompts: list[str | list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class Job:
    """A checked request, its prompts as token ids and its final sampling settings."""

    call: Call
    prompts: list[list[int]]
    params: SamplingParams
    chat: bool
    rid: str
    created: int


def parse(body: bytes, kind: type[pydantic.BaseModel]) -> Any:
    """The body as `kind`; a 400 naming the first bad field."""
    try:
        return kind.model_validate_json(body)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        if first.get("type") == "json_invalid" or not loc:
            raise OpenAIError(400, f"the body is not a JSON object: {first.get('msg')}") \
                from None
        name = loc[0]
        if name in HINTS:
            raise OpenAIError(400, f"{name}: must be {HINTS[name]}", name) from None
        where = ".".join(loc)
        raise OpenAIError(400, f"{where}: {first.get('msg')}", name) from None


def chat_call(body: ChatBody) -> Call:
    """A checked chat request; `messages` normalised to {role, content: str}."""
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    top = _in_range("top_logprobs", body.top_logprobs or 0, 0, MAX_TOP_LOGPROBS)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    return _call(body, max_tokens, name, bool(body.logprobs), top,
                 messages=_messages(body.messages))


def completion_call(body: CompletionBody) -> Call:
    """A checked completions request; `prompt` as a list of prompts."""
    prompts = _prompts(body.prompt)
    logprobs = body.logprobs is not None
    top = _in_range("logprobs", body.logprobs or 0, 0, MAX_TOP_LOGPROBS)
    max_tokens = COMPLETIONS_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    if body.echo and body.stream:
        raise OpenAIError(400, "echo with stream is not supported by retrain serve (leave "
                          "one out)", "echo")
    call = _call(body, max_tokens, "max_tokens", logprobs, top, prompts=prompts,
                 echo=bool(body.echo), least=0 if body.echo else 1)
    if len(prompts) * call.n > MAX_CHOICES:
        raise OpenAIError(400, f"n x prompts = {len(prompts) * call.n} completions; at most "
                          f"{MAX_CHOICES} a request", "n")
    return call


def _call(body: _Common, max_tokens: int | None, max_name: str, logprobs: bool, top: int,
          least: int = 1, **prompt: Any) -> Call:
    """`least`: the fewest tokens asked for (0: completions with `echo` score the prompt
    only, OpenAI's legacy way to score a text without sampling)."""
    _refuse(body)
    n = _in_range("n", 1 if body.n is None else body.n, 1, MAX_N)
    if body.best_of is not None and body.best_of != n:
        raise OpenAIError(400, "best_of is not supported by retrain serve (leave it out)",
                          "best_of")
    if max_tokens is not None and max_tokens < least:
        why = " (0 only scores the prompt, with echo: true on /v1/completions)" \
            if max_tokens == 0 else ""
        raise OpenAIError(400, f"{max_name} must be >= {least}, got {max_tokens}{why}",
                          max_name)
    temperature = _number("temperature", 1.0 if body.temperature is None
                          else body.temperature, 0.0, 2.0)
    top_p = _number("top_p", 1.0 if body.top_p is None else body.top_p, 0.0, 1.0)
    if top_p == 0:
        raise OpenAIError(400, "top_p must be in (0, 1], got 0", "top_p")
    if body.seed is not None:
        _in_range("seed", body.seed, 0, MAX_SEED)
    params = SamplingParams(max_tokens=max_tokens or 1, temperature=temperature, top_p=top_p,
                            seed=body.seed, stop_strings=_stops(body.stop),
                            top_logprobs=top)
    usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    return Call(model=body.model, n=n, params=params, max_tokens=max_tokens,
                logprobs=logprobs, top_logprobs=top, stream=bool(body.stream),
                include_usage=usage, **prompt)


def _refuse(body: pydantic.BaseModel) -> None:
    extra = body.model_extra or {}
    for name, allowed in REFUSED.items():
        if name in extra and extra[name] not in allowed:
            raise OpenAIError(400, f"{name} is not supported by retrain serve (leave it out)",
                              name)


def _in_range(name: str, value: int, lo: int, hi: int) -> int:
    if not lo <= value <= hi:
        raise OpenAIError(400, f"{name} must be between {lo} and {hi}, got {value}", name)
    return value


def _number(name: str, value: float, lo: float, hi: float) -> float:
    if not math.isfinite(value) or not lo <= value <= hi:
        raise OpenAIError(400, f"{name} must be a number in [{lo:g}, {hi:g}], got {value}",
                          name)
    return float(value)


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise OpenAIError(400, f"stop: at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    return tuple(s for s in stops if s)


def _messages(raw: list[dict]) -> list[dict]:
    if not raw:
        raise OpenAIError(400, "messages must hold at least one message", "messages")
    out = []
    for i, m in enumerate(raw):
        role = m.get("role")
        if role not in ROLES:
            raise OpenAIError(400, f"messages[{i}].role: {role!r} is not one of "
                              f"{', '.join(ROLES)} (tool messages are not supported)",
                              f"messages[{i}].role")
        if m.get("tool_calls") or m.get("function_call"):
            raise OpenAIError(400, f"messages[{i}]: tool calls are not supported by retrain "
                              "serve", f"messages[{i}].tool_calls")
        out.append({"role": ROLES[role], "content": _content(m.get("content"), i)})
    return out


def _content(content: Any, i: int) -> str:
    """A message's text: a string, or text parts joined by newlines."""
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise OpenAIError(400, f"{where}: only text parts ({{\"type\": \"text\", "
                                  "\"text\": ...}) are supported by retrain serve", where)
            texts.append(part["text"])
        return "\n".join(texts)
    raise OpenAIError(400, f"{where}: must be a string or a list of text parts", where)


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [list(prompt)]  # type: ignore[arg-type]
    else:
        prompts = list(prompt)  # type: ignore[arg-type]
    if not prompts:
        raise OpenAIError(400, "prompt is empty", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise OpenAIError(400, f"prompt: at most {MAX_PROMPTS} prompts a request, got "
                          f"{len(prompts)}", "prompt")
    return prompts

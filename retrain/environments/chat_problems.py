"""Chat-form problems: a problem given as chat messages (a system prompt, earlier turns, the
user's question) rather than one prompt string.

`chat_problem` checks the messages of one JSONL line or dataset row and builds its Problem
(the messages ride in `meta["messages"]`, `prompt` is the last user turn); `opening_messages`
is the conversation the model sees, system prompt kept, whichever form the problem came in.
Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from retrain.config.sections import DataConfig
from retrain.environments.answers import Problem
from retrain.environments.protocol import Message
from retrain.errors import UserError

ROLES = ("system", "user", "assistant")
CHAT_EXAMPLE = ('{"messages": [{"role": "system", "content": "Be brief."}, '
                '{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"}')


def chat_problem(messages: Any, answer: Any, where: str, meta: dict | None = None) -> Problem:
    """The Problem of chat `messages`; a trailing assistant turn is the answer when `answer`
    is None. UserError (naming `where`) on anything else."""
    fix = f"give messages as a list of {{\"role\", \"content\"}} objects, e.g. {CHAT_EXAMPLE}"
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: \"messages\" must be a non-empty list; {fix}")
    chat: list[Message] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES \
                or not isinstance(m.get("content"), str):
            raise UserError(f"{where}: messages[{i}] is not a {{\"role\": one of "
                            f"{', '.join(ROLES)}, \"content\": text}} object; {fix}")
        chat.append({"role": m["role"], "content": m["content"]})
    if chat[-1]["role"] == "assistant" and answer is None:
        answer = chat.pop()["content"]  # the reference reply doubles as the answer
    if not chat or chat[-1]["role"] != "user" or not chat[-1]["content"].strip():
        raise UserError(f"{where}: the messages must end with a non-empty user turn (the "
                        f"question the model answers); {fix}")
    if answer is None:
        raise UserError(f"{where}: missing \"answer\" (or a final assistant turn); {fix}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise UserError(f"{where}: \"answer\" must be a string or a number; {fix}")
    return Problem(prompt=chat[-1]["content"], answer=str(answer),
                   meta={**(meta or {}), "messages": chat})


def prompt_text(problem: Problem, data: DataConfig) -> str:
    """The user message: the problem, then the answer-format instruction."""
    return f"{problem.prompt}\n{data.instruction}" if data.instruction else problem.prompt


def opening_messages(problem: Problem, data: DataConfig) -> list[Message]:
    """What the model is shown: a chat-form problem's messages (system prompt kept) with the
    instruction on the last user turn, else the one user message."""
    chat = problem.meta.get("messages")
    if not chat:
        return [{"role": "user", "content": prompt_text(problem, data)}]
    out = [dict(m) for m in chat]
    out[-1]["content"] = prompt_text(problem, data)
    return out


def problem_key(problem: Problem) -> Any:
    """What makes two problems the same question (the whole chat for chat-form ones)."""
    chat = problem.meta.get("messages")
    return problem.prompt if not chat else tuple((m["role"], m["content"]) for m in chat)

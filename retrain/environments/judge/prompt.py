"""What the judge is asked and how its reply is read: the rubric with its placeholders filled,
the output format appended, and the score(s) found in the reply.

A pointwise request asks for one line `SCORE: x`; a group request numbers the completions of
one prompt and asks for `SCORE i: x` per completion. A score is a number in [0, 1]; a reply
without one (or out of range) is unparseable: None. Pure: no I/O.
"""

from __future__ import annotations

import re

DEFAULT_RUBRIC = """You are grading a reply to a question.

Question:
{prompt}

Reference answer (may be empty):
{answer}

Reply to grade:
{completion}

Judge whether the reply answers the question correctly and honestly. Do not reward length,
confidence or flattery."""

POINTWISE_FORMAT = ("\n\nEnd your response with one line `SCORE: x`, where x is a number from "
                    "0 (worst) to 1 (best).")
GROUP_FORMAT = ("\n\nThere are {n} replies, numbered [1] to [{n}]. Compare them with each "
                "other and score each from 0 (worst) to 1 (best). End your response with one "
                "line per reply: `SCORE 1: x`, `SCORE 2: x`, ... up to `SCORE {n}: x`.")

_NUMBER = r"([-+]?\d+(?:\.\d*)?|[-+]?\.\d+)"
_ONE = re.compile(r"score\s*[:=]\s*\**\s*" + _NUMBER, re.IGNORECASE)
_MANY = re.compile(r"score\s*\[?\s*(\d+)\s*\]?\s*[:=]\s*\**\s*" + _NUMBER, re.IGNORECASE)


def fill(rubric: str, prompt: str, completion: str, answer: str) -> str:
    """The rubric with its placeholders replaced (plain replacement: other braces stay)."""
    text = rubric or DEFAULT_RUBRIC
    for key, value in (("{prompt}", prompt), ("{answer}", answer),
                       ("{completion}", completion)):
        text = text.replace(key, value)
    return text


def pointwise_request(rubric: str, prompt: str, completion: str, answer: str) -> str:
    return fill(rubric, prompt, completion, answer) + POINTWISE_FORMAT


def group_request(rubric: str, prompt: str, completions: list[str], answer: str) -> str:
    """One request for all `completions` of a prompt: {completion} holds them, numbered."""
    block = "\n\n".join(f"[{i}]\n{c}" for i, c in enumerate(completions, start=1))
    return fill(rubric, prompt, block, answer) + GROUP_FORMAT.format(n=len(completions))


def _in_range(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0.0 <= value <= 1.0 else None


def parse_score(reply: str) -> float | None:
    """The last `SCORE: x` of the reply (or a reply that is just a number), x in [0, 1]."""
    found = _ONE.findall(reply)
    if found:
        return _in_range(found[-1])
    return _in_range(reply.strip()) if reply.strip() else None


def parse_group(reply: str, n: int) -> list[float] | None:
    """Scores 1..n from `SCORE i: x` lines (the last line for an i wins); None unless every
    completion has a score in [0, 1]."""
    scores: dict[int, float | None] = {}
    for index, value in _MANY.findall(reply):
        scores[int(index)] = _in_range(value)
    out = [scores.get(i) for i in range(1, n + 1)]
    return None if any(s is None for s in out) else [float(s) for s in out if s is not None]

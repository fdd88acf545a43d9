"""The backend's completions as OpenAI reply bodies: chat completions, completions, their
log-probs, usage, and the chunks of a stream (`TextStream`: the text safe to send so far).

A choice's text is its tokens decoded without special tokens, cut before the first stop
string (OpenAI never returns the stop text); its log-probs cover every sampled token but
the end-of-sequence one. Log-probs are those the sampler drew from (the tempered
distribution; temperature 0 reports temperature 1), -inf sent as -9999.0 (JSON has no
infinity). Pure: the tokenizer's functions are passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from retrain.backends.base import Completion

NEG_INF_AS = -9999.0  # what vLLM sends for a log-prob of -inf
Top = list[tuple[int, float]]


@dataclass(frozen=True)
class Tokens:
    """What replies need from the tokenizer."""

    decode: Callable[[list[int]], str]   # text of tokens, special tokens skipped
    piece: Callable[[int], str]          # one token's own text
    end_ids: frozenset[int]              # end-of-sequence tokens: not shown, not scored


@dataclass
class Choice:
    """One completion as OpenAI shows it."""

    index: int
    text: str
    finish_reason: str
    tokens: list[int]
    logprobs: list[float]
    top: list[Top] | None


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    """`text` up to (not including) the first stop string in it."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(ends)] if ends else text


def choice(index: int, c: Completion, tok: Tokens, stops: tuple[str, ...]) -> Choice:
    keep = len(c.tokens)
    if c.finish_reason == "stop" and keep and c.tokens[-1] in tok.end_ids:
        keep -= 1
    tokens = list(c.tokens[:keep])
    top = c.top_logprobs[:keep] if c.top_logprobs is not None else None
    return Choice(index, cut_at_stop(tok.decode(tokens), stops), c.finish_reason, tokens,
                  list(c.logprobs[:keep]), top)


def _lp(value: float) -> float:
    return value if math.isfinite(value) else NEG_INF_AS


def _entry(tok: Tokens, token: int, logprob: float) -> dict:
    text = tok.piece(token)
    return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tok: Tokens, tokens: list[int], logprobs: list[float],
                  top: list[Top] | None) -> dict:
    """`choices[i].logprobs` of a chat completion (or of one chunk)."""
    content = []
    for i, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        entry = _entry(tok, t, lp)
        entry["top_logprobs"] = [_entry(tok, a, alp) for a, alp in top[i]] if top else []
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(tok: Tokens, tokens: list[int], logprobs: list[float],
                        top: list[Top] | None, offset: int = 0) -> dict:
    """`choices[i].logprobs` of a completion: tokens, their log-probs, the top
    alternatives as {text: log-prob}, and each token's offset into the text."""
    pieces = [tok.piece(t) for t in tokens]
    offsets = []
    for p in pieces:
        offsets.append(offset)
        offset += len(p)
    return {"tokens": pieces, "token_logprobs": [_lp(lp) for lp in logprobs],
            "top_logprobs": [_by_text(tok, row) for row in top] if top is not None else None,
            "text_offset": offsets}


def _by_text(tok: Tokens, row: Top) -> dict[str, float]:
    """Top alternatives as {text: log-prob}; tokens of the same text (say, bytes that are
    half a character each) keep the likeliest."""
    out: dict[str, float] = {}
    for token, logprob in row:
        out.setdefault(tok.piece(token), _lp(logprob))
    return out


def usage(prompt_tokens: int, choices: list[Choice]) -> dict:
    done = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": done,
            "total_tokens": prompt_tokens + done}


def chat_body(rid: str, created: int, model: str, choices: list[Choice], tok: Tokens,
              logprobs: bool, prompt_tokens: int) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": c.index,
                         "message": {"role": "assistant", "content": c.text},
                         "logprobs": chat_logprobs(tok, c.tokens, c.logprobs, c.top)
                         if logprobs else None,
                         "finish_reason": c.finish_reason} for c in choices],
            "usage": usage(prompt_tokens, choices)}


def completion_body(rid: str, created: int, model: str, choices: list[Choice], tok: Tokens,
                    logprobs: bool, prompt_tokens: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": c.index, "text": c.text,
                         "logprobs": completion_logprobs(tok, c.tokens, c.logprobs, c.top)
                         if logprobs else None,
                         "finish_reason": c.finish_reason} for c in choices],
            "usage": usage(prompt_tokens, choices)}


class TextStream:
    """One choice's text while its tokens arrive: `push` gives the new text that is safe to
    send (never a stop string, nor text that may begin one, nor half a character), `finish`
    the rest of the final text."""

    def __init__(self, tok: Tokens, stops: tuple[str, ...]):
        self.tok = tok
        self.stops = stops
        self.tokens: list[int] = []
        self.sent = ""
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped or token in self.tok.end_ids:
            return ""
        self.tokens.append(token)
        text = self.tok.decode(self.tokens)
        cut = cut_at_stop(text, self.stops)
        if cut != text:
            self.stopped = True
        else:
            cut = cut[:len(cut) - self._held(cut)]
        return self._advance(cut)

    def finish(self, text: str) -> str:
        return self._advance(text)

    def _held(self, text: str) -> int:
        """Characters to hold back: a trailing U+FFFD (a character still arriving) and the
        longest end of `text` that begins a stop string."""
        held = 1 if text.endswith("\ufffd") else 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent):
            return ""  # the decoder changed earlier text (rare): send nothing it contradicts
        delta, self.sent = text[len(self.sent):], text
        return delta

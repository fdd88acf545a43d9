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
from retrain.backends.stop_strings import StopScan

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
    """One completion as OpenAI shows it; with `echo`, its first `echoed` tokens are the
    prompt's (log-prob None for the first, which nothing predicts)."""

    index: int
    text: str
    finish_reason: str
    tokens: list[int]
    logprobs: list[float | None]
    top: list[Top | None] | None
    echoed: int = 0


@dataclass(frozen=True)
class Echo:
    """A prompt as `echo` shows it before each of its choices: its text, tokens, their
    log-probs (None first) and, when asked for, the top alternatives at each position."""

    text: str
    tokens: list[int]
    logprobs: list[float | None]
    top: list[Top | None] | None


def echoed(c: Choice, e: Echo) -> Choice:
    """`c` after its prompt."""
    top = e.top + c.top if e.top is not None and c.top is not None else None
    return Choice(c.index, e.text + c.text, c.finish_reason, e.tokens + c.tokens,
                  e.logprobs + c.logprobs, top, echoed=len(e.tokens))


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


def _lp(value: float | None) -> float | None:
    if value is None:
        return None
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


def completion_logprobs(tok: Tokens, tokens: list[int], logprobs: list[float | None],
                        top: list[Top | None] | None, offset: int = 0) -> dict:
    """`choices[i].logprobs` of a completion: tokens, their log-probs, the top
    alternatives as {text: log-prob}, and each token's offset into the text."""
    pieces = [tok.piece(t) for t in tokens]
    offsets = []
    for p in pieces:
        offsets.append(offset)
        offset += len(p)
    return {"tokens": pieces, "token_logprobs": [_lp(lp) for lp in logprobs],
            "top_logprobs": [_by_text(tok, row) if row is not None else None for row in top]
            if top is not None else None,
            "text_offset": offsets}


def _by_text(tok: Tokens, row: Top) -> dict[str, float]:
    """Top alternatives as {text: log-prob}; tokens of the same text (say, bytes that are
    half a character each) keep the likeliest."""
    out: dict[str, float] = {}
    for token, logprob in row:
        out.setdefault(tok.piece(token), _lp(logprob))
    return out


def usage(prompt_tokens: int, choices: list[Choice]) -> dict:
    done = sum(len(c.tokens) - c.echoed for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": done,
            "total_tokens": prompt_tokens + done}


def seeding(dtype: str) -> dict:
    """What every reply says of its seed's reach: `system_fingerprint` names the dtype the
    server decodes in, and `seed_batch_invariant` whether a seeded request gives the same
    tokens whatever else is decoded with it: in float32 (tested on the CPU), not in bfloat16
    or float16, whose matrix kernels round differently for another batch size."""
    return {"system_fingerprint": f"retrain-{dtype}", "seed_batch_invariant": dtype == "float32"}


def chat_body(rid: str, created: int, model: str, choices: list[Choice], tok: Tokens,
              logprobs: bool, prompt_tokens: int, meta: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            **meta,
            "choices": [{"index": c.index,
                         "message": {"role": "assistant", "content": c.text},
                         "logprobs": chat_logprobs(tok, c.tokens, c.logprobs, c.top)
                         if logprobs else None,
                         "finish_reason": c.finish_reason} for c in choices],
            "usage": usage(prompt_tokens, choices)}


def completion_body(rid: str, created: int, model: str, choices: list[Choice], tok: Tokens,
                    logprobs: bool, prompt_tokens: int, meta: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            **meta,
            "choices": [{"index": c.index, "text": c.text,
                         "logprobs": completion_logprobs(tok, c.tokens, c.logprobs, c.top)
                         if logprobs else None,
                         "finish_reason": c.finish_reason} for c in choices],
            "usage": usage(prompt_tokens, choices)}


class TextStream:
    """One choice's text while its tokens arrive: `push` gives the new text that is safe to
    send (never a stop string, nor text that may begin one, nor half a character), `finish`
    the rest of the final text. Stop strings are looked for in the new text only
    (`StopScan`): a long stop string costs no more per token as the text grows."""

    def __init__(self, tok: Tokens, stops: tuple[str, ...]):
        self.tok = tok
        self.scan = StopScan(stops)
        self.tokens: list[int] = []
        self.sent = ""
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped or token in self.tok.end_ids:
            return ""
        self.tokens.append(token)
        text = self.tok.decode(self.tokens)
        first, held = self.scan.scan(text)
        if first is not None:
            self.stopped = True
            return self._advance(text[:first])
        if text.endswith("\ufffd"):  # a character still arriving
            held = max(held, 1)
        return self._advance(text[:len(text) - held])

    def finish(self, text: str) -> str:
        return self._advance(text)

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent):
            return ""  # the decoder changed earlier text (rare): send nothing it contradicts
        delta, self.sent = text[len(self.sent):], text
        return delta

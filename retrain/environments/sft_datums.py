"""One SFT datum: a conversation rendered as the model will see it, with weight 1 on the
assistant's tokens and 0 on everything else (system prompt, user turns, the template's role
headers), shifted for next-token prediction like every other datum.

Where a turn lies is found the way the rollout finds the environment's part
(environments/ledger.py): the conversation up to assistant turn k rendered with the generation
prompt is where its reply starts; rendered with turn k is where it ends. The template's
closing after the reply keeps its first token (SmolLM2's `<|im_end|>`: what the sampler stops
on) and drops the rest (the newline). Without a chat template the reply is the text after the
previous messages, and the tokenizer's EOS ends the last one. A template that renders an
earlier turn differently once later turns follow (one that strips an earlier reply's
reasoning) leaves that turn unweighted: it is counted, never guessed at.

Pure: the tokenizer comes in through the Renderer.
"""

from __future__ import annotations

from dataclasses import dataclass

from retrain.backends.base import Datum
from retrain.environments.ledger import Renderer
from retrain.environments.protocol import Message


@dataclass
class SftExample:
    """A conversation's datum (None: it rendered to fewer than two tokens) and its counts."""

    datum: Datum | None
    trained_tokens: int     # targets with weight 1
    tokens: int             # the sequence's length, after any cut
    truncated: bool         # longer than max_tokens: cut to it
    skipped_turns: int      # assistant turns the template renders differently in context


def weighted_tokens(renderer: Renderer, messages: list[Message],
                    eos: int | None = None) -> tuple[list[int], list[int], int]:
    """(the conversation's tokens, 1 on the assistant's and 0 elsewhere, assistant turns that
    could not be located)."""
    full = renderer.render(messages, generation=False)
    weights = [0] * len(full)
    skipped = 0
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        span = _turn_span(renderer, messages, k, full)
        if span is None:
            skipped += 1
            continue
        weights[span[0]:span[1]] = [1] * (span[1] - span[0])
    if not renderer.chat and eos is not None and messages and \
            messages[-1]["role"] == "assistant":
        full, weights = [*full, eos], [*weights, 1]  # the plain join has no end of turn
    return full, weights, skipped


def _turn_span(renderer: Renderer, messages: list[Message], k: int,
               full: list[int]) -> tuple[int, int] | None:
    """[start, end) of assistant turn k inside `full`, or None where the renders disagree."""
    if k == 0:
        return None  # nothing precedes it: there is no prompt it answers
    before = renderer.render(messages[:k], generation=True)
    upto = renderer.render(messages[:k + 1], generation=False)
    if full[:len(before)] != before or full[:len(upto)] != upto or len(upto) <= len(before):
        return None
    end, closing = len(upto), renderer.closing
    if len(closing) > 1 and upto[end - len(closing):] == closing:
        end -= len(closing) - 1  # keep the end-of-turn token, not what the template adds after
    return len(before), end


def sft_example(renderer: Renderer, messages: list[Message], max_tokens: int,
                eos: int | None = None) -> SftExample:
    """The datum of one conversation, cut to its first `max_tokens` tokens."""
    tokens, weights, skipped = weighted_tokens(renderer, messages, eos)
    truncated = len(tokens) > max_tokens
    tokens, weights = tokens[:max_tokens], weights[:max_tokens]
    if len(tokens) < 2:
        return SftExample(None, 0, len(tokens), truncated, skipped)
    w = [float(x) for x in weights[1:]]  # target i is token i + 1: its weight
    datum = Datum(input_tokens=tokens[:-1], target_tokens=tokens[1:],
                  logprobs=[0.0] * len(w), advantages=list(w), mask=list(w), weights=w)
    return SftExample(datum, int(sum(w)), len(tokens), truncated, skipped)

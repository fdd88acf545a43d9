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

from array import array
from dataclasses import dataclass

from retrain.backends.base import Datum
from retrain.environments.ledger import Renderer
from retrain.environments.protocol import Message


@dataclass(frozen=True)
class SftExample:
    """A conversation as trained: its tokens after any cut and 1 on the assistant's, kept
    compact (a run keeps one per row, tokenized once), and its counts."""

    ids: array              # the sequence's tokens, after any cut
    weights: bytes          # 1 where a token is the assistant's, else 0
    truncated: bool         # longer than max_tokens: cut to it
    skipped_turns: int      # assistant turns the template renders differently in context

    @property
    def tokens(self) -> int:
        """The sequence's length, after any cut."""
        return len(self.ids)

    @property
    def trained_tokens(self) -> int:
        """Targets with weight 1 (a sequence of fewer than two tokens has no target)."""
        return sum(self.weights[1:]) if len(self.ids) >= 2 else 0

    def datum(self) -> Datum | None:
        """The datum, shifted for next-token prediction (None below two tokens)."""
        if len(self.ids) < 2:
            return None
        ids, w = list(self.ids), [float(x) for x in self.weights[1:]]  # target i is token i + 1
        return Datum(input_tokens=ids[:-1], target_tokens=ids[1:], logprobs=[0.0] * len(w),
                     advantages=list(w), mask=list(w), weights=w)


def weighted_tokens(renderer: Renderer, messages: list[Message],
                    eos: int | None = None) -> tuple[list[int], list[int], int]:
    """(the conversation's tokens, 1 on the assistant's and 0 elsewhere, assistant turns that
    could not be located)."""
    full = renderer.render(messages, generation=False)
    weights = [0] * len(full)
    skipped = 0
    for k, message in enumerate(messages):
        if message["role"] != "assistant" or not message["content"].strip():
            continue  # an empty reply is not trained: it would only teach stopping at once
        span = _turn_span(renderer, messages, k, full)
        if span is None:
            skipped += 1
            continue
        weights[span[0]:span[1]] = [1] * (span[1] - span[0])
    if not renderer.chat and eos is not None and messages and \
            messages[-1]["role"] == "assistant":  # the plain join has no end of turn
        full, weights = [*full, eos], [*weights, int(bool(messages[-1]["content"].strip()))]
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
    """One conversation, cut to its first `max_tokens` tokens. A conversation whose first
    reply starts past the cut is measured by its prompt alone (a huge prompt is rendered
    once, not three times) and trains nothing."""
    first = next((k for k, m in enumerate(messages) if m["role"] == "assistant" and k), None)
    if first is not None:
        prompt = renderer.render(messages[:first], generation=True)
        if len(prompt) >= max_tokens:
            return SftExample(array("l", prompt[:max_tokens]), bytes(max_tokens), True, 0)
    tokens, weights, skipped = weighted_tokens(renderer, messages, eos)
    return SftExample(array("l", tokens[:max_tokens]), bytes(weights[:max_tokens]),
                      len(tokens) > max_tokens, skipped)


EMPTY, LONG = "an empty reply", "a prompt longer than sft.max_tokens"


def never_trains(renderer: Renderer, messages: list[Message], max_tokens: int) -> str | None:
    """Why a conversation can never train a token (EMPTY: every reply is blank; LONG: its
    first reply starts past `max_tokens`, so the cut leaves none of it), or None. One render
    at most: `retrain explain` counts every row with it."""
    replies = [k for k, m in enumerate(messages)
               if m["role"] == "assistant" and k and m["content"].strip()]
    if not replies:
        return EMPTY
    if len(renderer.render(messages[:replies[0]], generation=True)) >= max_tokens:
        return LONG
    return None

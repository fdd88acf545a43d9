"""Stop strings: where a completion ends when it stops on text rather than on token ids.

A stop string is matched on the decoded text; the completion keeps every token up to and
including the one that completes the first stop string, and nothing after. The stop text
stays in the tokens, as hosted Tinker (and vLLM-style samplers) return it: clients such
as tinker-cookbook's `role_colon` renderer split the decoded response on it and count a
response without it as cut short. Pure: the tokenizer's decode is passed in.

Two ways to find that token: `StopWatch` while decoding (the local sampler asks after every
token, so a row ends as soon as its stop text appears) and `first_stop_end` afterwards, on a
finished completion (a sampler that cannot stop on text, e.g. hosted Tinker's when EOS ids
must be sent instead). Both give the same cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from retrain.backends.base import Completion

Decode = Callable[[list[int]], str]

# One character is at most 4 UTF-8 bytes, so at most 4 byte-level tokens (plus one that
# started before it): the tokens that can hold a stop string of n characters.
TOKENS_PER_CHAR = 4


class StopWatch:
    """Has a growing completion just completed one of `stops`? Asked after every new token,
    it decodes only the last few tokens (enough for the longest stop string), not the whole
    completion: the first occurrence always ends in the newest token's text."""

    def __init__(self, stops: Sequence[str], decode: Decode):
        self.stops = tuple(s for s in stops if s)
        self.decode = decode
        self.window = TOKENS_PER_CHAR * max((len(s) for s in self.stops), default=0) + 1

    def __bool__(self) -> bool:
        return bool(self.stops)

    def hit(self, tokens: Sequence[int]) -> bool:
        """A match in the last tokens' text is confirmed on the whole text: cut mid-character,
        the window starts with a U+FFFD that the whole text does not have."""
        if not self._holds(tokens[-self.window:]):
            return False
        return len(tokens) <= self.window or self._holds(tokens)

    def _holds(self, tokens: Sequence[int]) -> bool:
        text = self.decode(list(tokens))
        return any(s in text for s in self.stops)


def first_stop_end(tokens: Sequence[int], stops: Sequence[str], decode: Decode) -> int | None:
    """The length of the shortest token prefix whose text contains a stop string, or None.

    Containment only grows with the prefix, so a binary search needs about log2(n) decodes.
    """
    def hit(n: int) -> bool:
        text = decode(list(tokens[:n]))
        return any(s in text for s in stops)

    stops = [s for s in stops if s]
    if not stops or not tokens or not hit(len(tokens)):
        return None
    lo, hi = 1, len(tokens)  # hit(hi) is true
    while lo < hi:
        mid = (lo + hi) // 2
        if hit(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def cut_at_stop_strings(c: Completion, stops: Sequence[str], decode: Decode) -> Completion:
    """`c` ended with the token that completes its first stop string (finish_reason "stop")."""
    end = first_stop_end(c.tokens, stops, decode)
    if end is None:
        return c
    return Completion(list(c.tokens[:end]), list(c.logprobs[:end]), "stop")

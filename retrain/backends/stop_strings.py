"""Stop strings: where a completion ends when it stops on text rather than on token ids.

A stop string is matched on the decoded text; the completion keeps every token up to and
including the one that completes the first stop string, and nothing after. The stop text
stays in the tokens, as hosted Tinker (and vLLM-style samplers) return it: clients such
as tinker-cookbook's `role_colon` renderer split the decoded response on it and count a
response without it as cut short. Pure: the tokenizer's decode is passed in.

`StopScan` answers the same question on text that arrives piece by piece (a streamed reply):
where the first stop string begins and how much of the end may still begin one, with work
for the new text only.

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


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the first stop string in `text` begins (the whole-text answer), or None."""
    ends = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(ends) if ends else None


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """The longest end of `text` that begins a stop string and is shorter than it (the
    whole-text answer: text that may be the start of a stop string still arriving)."""
    held = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held


def _borders(s: str) -> list[int]:
    """Knuth-Morris-Pratt: for each prefix s[:i+1], its longest proper prefix that is also
    its suffix."""
    border, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = border[k - 1]
        if s[i] == s[k]:
            k += 1
        border[i] = k
    return border


class StopScan:
    """`first_stop` and `stop_prefix_len` of a text that grows, with work for the new text
    only (plus a short tail): one matcher state per stop string (Knuth-Morris-Pratt), the
    length of the text's longest end that begins it. The last LAG characters are scanned
    again on every call, because a decoder may still rewrite them (a character whose bytes
    are still arriving); a text that does not begin with the text already settled (a
    rewrite further back) is scanned again from its start. Any text gets the whole-text
    answers."""

    LAG = 8

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._borders = [_borders(s) for s in self.stops]
        self._reset()

    def _reset(self) -> None:
        self._settled = ""
        self._states = [0] * len(self.stops)
        self._first: int | None = None

    def scan(self, text: str) -> tuple[int | None, int]:
        """(`first_stop(text)`, `stop_prefix_len(text)`)."""
        if not text.startswith(self._settled):
            self._reset()
        settle = max(len(self._settled), len(text) - self.LAG)
        self._first = self._feed(self._states, text, len(self._settled), settle, self._first)
        self._settled = text[:settle]
        states = list(self._states)
        first = self._feed(states, text, settle, len(text), self._first)
        return first, max(states, default=0)

    def _feed(self, states: list[int], text: str, start: int, end: int,
              first: int | None) -> int | None:
        """Advance `states` over text[start:end]; the earliest stop start seen, or `first`."""
        for j, (s, border) in enumerate(zip(self.stops, self._borders, strict=True)):
            k, n = states[j], len(s)
            for i in range(start, end):
                c = text[i]
                while k and c != s[k]:
                    k = border[k - 1]
                if c == s[k]:
                    k += 1
                if k == n:  # a match ends at i: text[i - n + 1 : i + 1] == s
                    if first is None or i - n + 1 < first:
                        first = i - n + 1
                    k = border[k - 1]
            states[j] = k
        return first

"""Stop strings: where a completion ends when a client stops on text rather than token ids.

A stop string is matched on the decoded text; the completion keeps every token up to and
including the one that completes the first stop string, and nothing after. The stop text
stays in the tokens, as hosted Tinker (and vLLM-style samplers) return it: clients such
as tinker-cookbook's `role_colon` renderer split the decoded response on it and count a
response without it as cut short. Pure: the tokenizer's decode is passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from retrain.backends.base import Completion


def first_stop_end(tokens: Sequence[int], stops: Sequence[str],
                   decode: Callable[[list[int]], str]) -> int | None:
    """The length of the shortest token prefix whose text contains a stop string, or None.

    Containment only grows with the prefix, so a binary search needs about log2(n) decodes.
    """
    def hit(n: int) -> bool:
        text = decode(list(tokens[:n]))
        return any(s in text for s in stops)

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


def cut_at_stop_strings(c: Completion, stops: Sequence[str],
                        decode: Callable[[list[int]], str]) -> Completion:
    """`c` ended with the token that completes its first stop string (finish_reason "stop")."""
    end = first_stop_end(c.tokens, stops, decode)
    if end is None:
        return c
    return Completion(list(c.tokens[:end]), list(c.logprobs[:end]), "stop")

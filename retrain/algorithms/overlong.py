"""Overlong shaping: DAPO's soft punishment of completions near the length limit (pure).

With L = training.max_tokens and a buffer B ([reward] overlong_buffer), a completion of n
tokens gets, added to its reward before the advantages (Yu et al. 2025, DAPO, eq. 13):
0 for n <= L - B; -penalty x (n - (L - B)) / B inside the buffer; -penalty beyond L.
"""

from __future__ import annotations


def overlong_penalty(tokens: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """The (non-positive) reward added to a completion of `tokens` tokens; 0 when buffer = 0."""
    if buffer <= 0:
        return 0.0
    start = max_tokens - buffer
    if tokens <= start:
        return 0.0
    if tokens > max_tokens:
        return -penalty
    return -penalty * ((tokens - start) / buffer)

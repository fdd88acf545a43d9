"""The sampling work a server has taken on and not yet finished, and its bound.

Every sample request, of either API, owes `rows x (prompt + max_tokens)` tokens of KV cache
while it waits for the model and while it is decoded (requests with the same settings are
decoded in one batch, so queued work is memory the next batch takes). A request that would
take the backlog past its bound is refused at once with HTTP 429 (retry-after), instead of
queueing work that the server could only do minutes later, or not within its memory. A
request is always taken when nothing else is queued, however large (its own limits are the
routes' checks). The work is given back when the request ends: finished, failed, or left
because its client is gone.

The default bound is the KV cache that half the device's memory holds (`default_bound`);
`retrain serve --max-queued-tokens` sets another. Runs on the event loop: no locks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from retrain.serve.errors import ApiError


@dataclass
class Backlog:
    """Tokens owed by the sample requests in flight; `bound` None = no bound."""

    bound: int | None = None
    tokens: int = 0
    requests: int = 0
    refused: int = 0

    def take(self, tokens: int) -> int:
        """Take on a request of `tokens`; returns what to `give_back` once it ends. Raises
        ApiError(429) when the backlog is not empty and would pass the bound."""
        if self.bound is not None and self.requests and self.tokens + tokens > self.bound:
            self.refused += 1
            raise ApiError(429, f"retrain serve is busy: {self.tokens} tokens of sampling are "
                           f"queued and this request adds {tokens}, past the bound of "
                           f"{self.bound} (--max-queued-tokens); retry when some finish")
        self.tokens += tokens
        self.requests += 1
        return tokens

    def give_back(self, tokens: int) -> None:
        self.tokens -= tokens
        self.requests -= 1


def owed(prompt_lengths: list[int], n: int, max_tokens: int) -> int:
    """The tokens of KV cache a request of these prompts, `n` samples each, may fill."""
    return sum(n * (length + max_tokens) for length in prompt_lengths)


def default_bound(kv_bytes_per_token: int, device_bytes: int | None = None) -> int:
    """Tokens whose KV cache fills half of `device_bytes` (default: this machine's memory)."""
    if device_bytes is None:
        device_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, device_bytes // 2 // max(1, kv_bytes_per_token))

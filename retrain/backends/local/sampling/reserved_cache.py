"""A KV cache with room reserved up front for the local sampler.

transformers' `DynamicLayer` concatenates each new token's keys and values onto the whole
cache (a copy of everything cached, per layer and per decoding step). `ReservedLayer` keeps
them in buffers sized for prompt + max_tokens: a step writes its token in place and attention
reads a view of the filled part. Rows leaving the batch and the prompt's repeat for its
samples still copy, as before (rarely: once per prompt, once per finished row set).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer


class ReservedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values live in buffers of `capacity` positions."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        b, h, _, _ = key_states.shape
        cap = max(self.capacity, key_states.shape[-2])
        self._k = key_states.new_empty((b, h, cap, key_states.shape[-1]))
        self._v = value_states.new_empty((b, h, cap, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self._k.shape[-2]:  # past the reservation: grow (not expected)
            self._k = _grown(self._k, end)
            self._v = _grown(self._v, end)
        self._k[:, :, self.length:end] = key_states
        self._v[:, :, self.length:end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def _views(self) -> None:
        self.keys = self._k[:, :, :self.length]
        self.values = self._v[:, :, :self.length]

    def get_seq_length(self) -> int:
        return self.length

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.length > 0:
            self._k = self._k.repeat_interleave(repeats, dim=0)
            self._v = self._v.repeat_interleave(repeats, dim=0)
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.length > 0:
            self._k = self._k[indices]
            self._v = self._v[indices]
            self._views()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last `-tokens_to_remove` positions (transformers' convention: a
        negative count); the buffers stay reserved."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes the number of positions to remove, negated")
        if self.length > 0:
            self.length = max(self.length + tokens_to_remove, 0)
            self._views()

    def reset(self) -> None:
        self.keys = self.values = self._k = self._v = None
        self.length = 0
        self.is_initialized = False


def _grown(buffer: torch.Tensor, length: int) -> torch.Tensor:
    b, h, cap, d = buffer.shape
    out = buffer.new_empty((b, h, max(length, 2 * cap), d))
    out[:, :, :cap] = buffer
    return out


def reserve(cache: Any, capacity: int) -> Any:
    """Give every plain (full-attention) layer of `cache` room for `capacity` positions;
    sliding-window and other special layers stay as they are."""
    cache.layers = [ReservedLayer(capacity) if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]
    return cache

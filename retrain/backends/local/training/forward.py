"""One micro-batch through the model: its kept targets' log-probs, in its layout (pack.py).

- prefix: the distinct prompt prefixes run once into a KV cache (`cache` of the sampler's
  kind), then the suffixes in length buckets, each on its rows of that cache.
- packed: one forward of the rows with `position_ids` restarting per sequence,
  `attention_mask=None` and `use_cache=False`. transformers (5.x, masking_utils) then finds
  the sequences from the position ids and makes the attention block-diagonal and causal; with
  a cache (which `use_cache` left at the config's default, True, creates) it does not, and
  packed sequences silently attend to each other
  (tests/backends/local/training/test_training_forward.py checks both).

`layout_for` picks one per device: prefix where it was measured to win (the CPU: a prompt
runs once for its group, and the extra forward call costs little there), packed on CUDA,
where one forward call of few large rows beats two calls per micro-batch and a copy of the
prefix cache per bucket (bench/gpu/main.py measures both layouts on the card).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from retrain.backends.base import Datum
from retrain.backends.local.training.logprobs import Head
from retrain.backends.local.training.pack import (
    BUCKET_OVERHEAD,
    Packed,
    Rows,
    length_buckets,
    pack,
    pack_rows,
)
from retrain.backends.local.training.plan import Unit

LAYOUTS = ("prefix", "packed")


def layout_for(device: torch.device) -> str:
    """The layout a device trains in (see the module's docstring)."""
    return "packed" if device.type == "cuda" else "prefix"


@dataclass
class Forward:
    """How micro-batches run through one model: its `Head`, the layout, and (prefix layout)
    the KV cache the model takes, under the keyword it takes it."""

    head: Head
    layout: str
    cache_key: str
    make_cache: Callable[[], Any]
    bucket_overhead: int = BUCKET_OVERHEAD

    @property
    def packed(self) -> bool:
        return self.layout == "packed"

    def pack(self, datums: list[Datum], unit: Unit, pad_id: int, device: torch.device,
             weights: Sequence[float] | None = None, with_ref: bool = False) -> Packed | Rows:
        """The micro-batch's tensors in this layout."""
        return (pack_rows if self.packed else pack)(datums, unit, pad_id, device, weights,
                                                    with_ref)

    def logprobs(self, batch: Packed | Rows, temperature: float) -> torch.Tensor:
        """The log-probs of `batch.t.tokens`, in their order (with their gradient)."""
        if isinstance(batch, Rows):
            kept = self.head.kept(batch.keep, input_ids=batch.input_ids,
                                  position_ids=batch.positions, attention_mask=None,
                                  use_cache=False)
            return self.head.logprobs(kept, batch.t.tokens, temperature)
        return self._prefix_layout(batch, temperature)

    def _prefix_layout(self, batch: Packed, temperature: float) -> torch.Tensor:
        """Prefixes once, suffixes in length buckets on their rows of the prefix KV cache,
        each bucket's kept positions through the head as the bucket's own matmul (so the
        numbers are those of the path before, to the bit, in bfloat16 too)."""
        prefix = None if batch.prefix_ids is None else self._prefix_kv(batch)
        entry = (batch.keep.flatten().cumsum(0) - 1).view_as(batch.keep)  # index in targets
        parts, order = [], []
        for run in length_buckets(batch.lengths, self.bucket_overhead):
            rows = torch.tensor(run, device=batch.input_ids.device)
            width = max(batch.lengths[r] for r in run)
            keep = batch.keep[rows, :width]
            args: dict[str, Any] = {}  # right padding alone needs no attention mask
            if prefix is not None:
                prows = batch.row_prefix[rows]
                cache = self.make_cache()
                for layer, (k, v) in enumerate(prefix):
                    cache.update(k[prows], v[prows], layer)
                args = {"attention_mask": torch.cat([batch.prefix_mask[prows],
                                                     batch.suffix_mask[rows, :width]], dim=1),
                        "position_ids": batch.positions[rows, :width],
                        self.cache_key: cache, "use_cache": True}
            kept = self.head.kept(keep, input_ids=batch.input_ids[rows, :width], **args)
            order.append(entry[rows, :width][keep])
            parts.append(self.head.logprobs(kept, batch.t.tokens[order[-1]], temperature))
        return torch.cat(parts)[torch.argsort(torch.cat(order))]

    def _prefix_kv(self, batch: Packed) -> list[tuple[Any, Any]]:
        """Each layer's keys and values of the distinct prefixes (with gradients in training)."""
        cache = self.make_cache()
        positions = (batch.prefix_mask.cumsum(-1) - 1).clamp(min=0)
        self.head.prefill(input_ids=batch.prefix_ids, attention_mask=batch.prefix_mask,
                          position_ids=positions, **{self.cache_key: cache}, use_cache=True)
        return [(layer.keys, layer.values) for layer in cache.layers]

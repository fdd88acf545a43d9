"""The trainer's log-probs of the kept targets: the LM head and the float32 log-softmax over
the vocabulary, in chunks of rows, so that `[kept positions x vocab]` logits never exist at
once, in the forward or the backward.

The sampler's definition, once (sampling.exact.token_logprobs): float32
`log_softmax(logits / temperature)` of the head's logits, gathered at the targets. A chunk of
rows is that same math on a slice of the kept hidden states. With more than one chunk each
runs under activation checkpointing: its forward keeps only its input (hidden states, not
logits), and its backward runs the chunk again, so one chunk's logits are alive at a time
(the head's matmul runs once more per chunk: a few percent of a step). One chunk, as on the
CPU, is the plain computation, nothing recomputed.

`Head` splits a model into its body (the decoder, which yields hidden states) and its LM
head where the model's logits are exactly `lm_head(hidden)`: the architectures in
`PLAIN_HEADS`. Others (a soft-capped or scaled head) keep the model's own forward with
`logits_to_keep`, which computes the kept positions' logits at once.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from retrain.backends.local.sampling.exact import token_logprobs

CHUNK_ENTRIES = 2**26     # logit entries (rows x vocab) of one chunk: 256 MiB in float32
PLAIN_HEADS = ("llama", "mistral", "qwen2", "qwen3")  # logits = lm_head(last hidden state)

_compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def chunk_rows(vocab_size: int, entries: int = CHUNK_ENTRIES) -> int:
    """Rows of one chunk: `entries` logit entries, at least one row."""
    return max(1, entries // max(1, vocab_size))


def chunked_logprobs(lm_head: Any, hidden: torch.Tensor, targets: torch.Tensor,
                     temperature: float, rows: int) -> torch.Tensor:
    """log p(targets[k] | hidden[k]) for (n, H) hidden states, `rows` at a time."""
    def piece(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return token_logprobs(lm_head(h), temperature).gather(-1, t[:, None]).squeeze(-1)

    n = hidden.shape[0]
    if n <= rows:
        return piece(hidden, targets)
    recompute = torch.is_grad_enabled() and hidden.requires_grad
    parts = []
    for start in range(0, n, rows):
        h, t = hidden[start:start + rows], targets[start:start + rows]
        parts.append(checkpoint(piece, h, t, use_reentrant=False) if recompute else piece(h, t))
    return torch.cat(parts)


class Head:
    """A model's body and LM head, as the trainer runs them (see the module's docstring).
    `compile`: the body through torch.compile (CUDA, where a measurement says it pays)."""

    def __init__(self, net: Any, entries: int = CHUNK_ENTRIES, compile: bool = False,
                 model_forward: bool = False):
        """`model_forward`: the model's own forward even where the head is plain (the path
        before chunking, which the tests compare with)."""
        base = net.get_base_model() if hasattr(net, "get_base_model") else net
        self.net = net
        self.lm_head = base.get_output_embeddings()
        plain = getattr(base.config, "model_type", None) in PLAIN_HEADS
        self.body = base.get_decoder() if plain and not model_forward else None
        if self.body is not None and compile:
            self.body = compiled(self.body)
        self.rows = chunk_rows(int(self.lm_head.weight.shape[0]), entries)

    @property
    def chunked(self) -> bool:
        """Whether the kept positions' logits are made a chunk at a time."""
        return self.body is not None

    def kept(self, keep: torch.Tensor, **forward: Any) -> torch.Tensor:
        """What the forward gives at the `keep` positions (row-major): hidden states where the
        head is plain, else the model's logits of those positions."""
        if self.body is None:
            return self.net(logits_to_keep=keep, **forward).logits
        return self.body(**forward).last_hidden_state[keep]

    def logprobs(self, kept: torch.Tensor, targets: torch.Tensor,
                 temperature: float) -> torch.Tensor:
        """The targets' log-probs from `kept` (what `kept` returned)."""
        if self.body is None:
            return token_logprobs(kept, temperature).gather(-1, targets[:, None]).squeeze(-1)
        return chunked_logprobs(self.lm_head, kept, targets, temperature, self.rows)

    def prefill(self, **forward: Any) -> None:
        """A forward that only fills a KV cache (no logits where the head is plain)."""
        if self.body is None:
            self.net(logits_to_keep=1, **forward)
        else:
            self.body(**forward)


def compiled(body: Any) -> CompiledBody:
    """`body` through torch.compile, made once per module."""
    if body not in _compiled:
        _compiled[body] = CompiledBody(body)
    return _compiled[body]


class CompiledBody:
    """A body through torch.compile (dynamic shapes: the rows and their length vary, so it
    does not compile again every step). A compile that fails costs one line on stderr and the
    body runs eagerly from then on (an out-of-memory error is no compile failure)."""

    def __init__(self, body: Any):
        self.eager = body
        self.fn = torch.compile(body, dynamic=True)
        self.failed: str | None = None

    def __call__(self, **forward: Any) -> Any:
        if self.failed is None:
            try:
                return self.fn(**forward)
            except Exception as exc:  # noqa: BLE001 - any compiler fault: run eagerly
                from retrain.backends.local.device import is_oom

                if is_oom(exc):
                    raise
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                self.failed = f"{type(exc).__name__}: {first}"
                print(f"note: the compiled training forward failed ({self.failed}); "
                      "running it eagerly", file=sys.stderr)
        return self.eager(**forward)

"""What `retrain serve` needs from a model: the engine interface.

The HTTP/protobuf/futures layer talks only to an `Engine`; the real one runs the local
backend (`local_engine.py`), tests use small doubles. Engine methods are blocking and are
called from worker threads, never from the event loop. The datatypes are the backend
contract's (`backends/base.py`), read with Tinker's semantics: a datum's loss inputs are
the client's, summed over every position (no mask: positions not to train carry advantage
or weight 0). Pure: no torch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from retrain.algorithms import losses
from retrain.backends.base import AdamParams, Completion, Datum, LossOutput, SamplingParams

# Loss functions the server computes (Tinker names) and the per-token inputs each reads: the
# shared definitions of algorithms/losses.py, summed over all positions as Tinker returns them.
LOSS_INPUTS: dict[str, tuple[str, ...]] = losses.INPUTS


class EngineError(Exception):
    """A request the engine cannot serve because of what the client sent (category "user")."""


@dataclass
class SampleResult:
    """The completions of one sample request, and the prompt's log-probs when asked for."""

    sequences: list[Completion]
    prompt_logprobs: list[float] | None = None  # NaN at position 0
    # the most likely (token, log-prob) at each prompt position (None at 0), when asked for
    prompt_top: list[list[tuple[int, float]] | None] | None = None


class Engine(Protocol):
    """One base model in memory; named LoRA adapters, each with its own optimizer."""

    base_model: str      # the name clients pass as `base_model`
    tokenizer_id: str    # reported by get_info: a local folder, so clients load it offline
    arch: str
    vocab_size: int      # token ids a request may use: 0 .. vocab_size - 1
    max_context: int | None  # prompt + completion tokens the model takes (None: no limit)

    def accepts(self, base_model: str) -> bool:
        """Whether `base_model` names the model this engine serves."""
        ...

    def create_adapter(self, model_id: str, rank: int, seed: int | None) -> None: ...

    def drop_adapter(self, model_id: str) -> None: ...

    def forward_backward(self, model_id: str, data: list[Datum], loss_fn: str,
                         config: dict[str, float], forward_only: bool) -> LossOutput:
        """Tinker semantics: the loss is a sum over datums and tokens; gradients accumulate."""
        ...

    def optim_step(self, model_id: str, adam: AdamParams) -> dict[str, float]: ...

    def save_state(self, model_id: str, folder: Path) -> None:
        """Adapter weights + optimizer state into `folder` (which exists and is empty)."""
        ...

    def load_state(self, model_id: str, folder: Path, optimizer: bool) -> None: ...

    def snapshot(self, model_id: str) -> Any:
        """A frozen copy of the adapter's weights to sample from while training goes on."""
        ...

    def drop_snapshot(self, snap: Any) -> None:
        """Free a snapshot from `snapshot` or `read_snapshot` (None: nothing to free)."""
        ...

    def write_snapshot(self, snap: Any, folder: Path) -> None: ...

    def read_snapshot(self, folder: Path) -> Any:
        """Sampler weights from a folder written by `write_snapshot` or `save_state`."""
        ...

    def sample(self, snap: Any, prompt: list[int], n: int, params: SamplingParams,
               prompt_logprobs: bool, cancel: threading.Event | None = None) -> SampleResult:
        """`n` continuations of `prompt` under `snap` (None = the base model). Once `cancel`
        is set (its client is gone) the work may stop early with an EngineError. An engine
        that streams (the local one, for the OpenAI routes' `stream`) also takes an `on_token`
        keyword: called with (index among the n, token, log-prob, top log-probs or None) for
        each token as it is drawn."""
        ...

"""What rank 0 sends the other ranks, one message per rank per call, and what comes back.
Every rank runs the same kind of message at once, so the collectives inside line up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from retrain.algorithms.aggregation import Normaliser
from retrain.backends.base import AdamParams, Datum, LossConfig, SamplingParams, TokenIds


@dataclass
class Sample:
    prompts: list[TokenIds]
    n: int
    params: SamplingParams


@dataclass
class Train:
    """One share of a forward_backward call: its datums, their weights in the whole call's
    normaliser (`norm`: this share's weights, the call's denominator) and the call's loss
    tokens. `tokens` 0: the whole call has none (no gradient anywhere)."""

    datums: list[Datum]
    loss: LossConfig
    norm: Normaliser
    tokens: int


@dataclass
class Step:
    """optim_step on every rank; `loss_finite`: the whole call's loss was finite."""

    adam: AdamParams
    loss_finite: bool


@dataclass
class Logprobs:
    datums: list[Datum]
    temperature: float
    reference: bool


@dataclass
class Weights:
    """Rank 0's trained weights, optimizer and generator state: every rank takes them (whole
    tensors; a sharded rank slices out its shards, fsdp.py)."""

    params: dict[str, Any]
    optimizer: dict[str, Any]
    generator: Any


@dataclass
class Save:
    """save_state on every rank (sharded training: each gathers its shards); rank 0 writes."""

    name: str


@dataclass
class Close:
    """The run is over: the other ranks leave their loop."""


@dataclass
class Reply:
    """A rank's result, or its error: `kind` names the error's class (oom, diverged, backend,
    other) so rank 0 raises the one the trainer handles."""

    value: Any = None
    error: str = ""
    kind: str = ""

"""FLOPs and bytes moved by one RL step, estimated for the roofline (docs/backpressure.md)
and for the machine bound (`python -m bench.bound`).

Pure: no torch, no I/O. The backend describes its model (`ModelCost`); the trainer counts the
step's tokens. Estimates, not measurements: they place a step on the roofline, nothing else.

- FLOPs: a token through the layers costs 2 x the body's parameters (one multiply-add per
  weight); a position whose logits are computed adds 2 x the LM head's. The sampler prefills
  each distinct prompt once (only its last position gets logits) and every sampled token gets
  logits. Training costs 4x per token (forward, plus a backward that needs activation
  gradients only: the frozen weights get no weight gradient, and LoRA's are negligible); every
  trained token gets logits, and each micro-batch runs its prompts once more.
- Bytes: the weights are read once per forward or backward pass (the prefill, each decoding
  step of the sampled batch, and a forward and a backward per training micro-batch), plus the
  KV cache read at each decoding step (a completion's token t reads prompt + t cached tokens).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelCost:
    """What the estimates need from the model."""

    parameters: int            # N, all parameters (frozen base and adapter)
    weight_bytes: int          # bytes of all parameters as stored
    kv_bytes_per_token: int    # 2 (K and V) x layers x kv heads x head dim x element size
    body_parameters: int = 0   # multiply-adds per token through the layers (0: unknown, N)
    head_parameters: int = 0   # multiply-adds of the LM head per position with logits

    @property
    def body(self) -> int:
        return self.body_parameters or self.parameters


@dataclass(frozen=True)
class StepCost:
    flops: float
    bytes_moved: float

    def __add__(self, other: StepCost) -> StepCost:
        return StepCost(self.flops + other.flops, self.bytes_moved + other.bytes_moved)


def prefill_cost(model: ModelCost, prompt_lengths: list[int]) -> StepCost:
    """Each distinct prompt once, logits at its last position only, one pass over the weights."""
    flops = 2.0 * model.body * sum(prompt_lengths) + 2.0 * model.head_parameters * len(
        prompt_lengths)
    return StepCost(flops=flops, bytes_moved=float(model.weight_bytes) if prompt_lengths else 0.0)


def decode_cost(model: ModelCost, prompt_lengths: list[int],
                completion_lengths: list[list[int]]) -> StepCost:
    """Every sampled token through the model and its LM head; one pass over the weights per
    decoding step (the batch decodes together) plus the KV cache each token reads."""
    tokens = sum(sum(c) for c in completion_lengths)
    flops = 2.0 * (model.body + model.head_parameters) * tokens
    steps = max((max(c, default=0) for c in completion_lengths), default=0)
    cached = sum(n * p + n * (n - 1) / 2 for p, c in zip(prompt_lengths, completion_lengths,
                                                       strict=True) for n in c)
    return StepCost(flops=flops, bytes_moved=float(model.weight_bytes) * steps
                    + float(model.kv_bytes_per_token) * cached)


def sample_cost(model: ModelCost, prompt_lengths: list[int],
                completion_lengths: list[list[int]]) -> StepCost:
    """`completion_lengths[i]`: the completions of prompt i (one sampling call decodes them)."""
    return prefill_cost(model, prompt_lengths) + decode_cost(model, prompt_lengths,
                                                             completion_lengths)


def train_cost(model: ModelCost, trained_tokens: int, micro_batches: int,
               prefix_tokens: int = 0) -> StepCost:
    """Forward and backward of `trained_tokens` (all with logits) and of `prefix_tokens`
    (the prompts each micro-batch runs once, without logits); weights read twice per
    micro-batch."""
    flops = 4.0 * (model.body + model.head_parameters) * trained_tokens \
        + 4.0 * model.body * prefix_tokens
    passes = 2 * max(micro_batches, 1 if trained_tokens else 0)
    return StepCost(flops=flops, bytes_moved=float(model.weight_bytes) * passes)


def step_cost(model: ModelCost, prompt_lengths: list[int], completion_lengths: list[list[int]],
              trained_tokens: int, micro_batches: int) -> StepCost:
    """Sampling plus training of one step (see the module docstring)."""
    return sample_cost(model, prompt_lengths, completion_lengths) + train_cost(
        model, trained_tokens, micro_batches)

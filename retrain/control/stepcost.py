"""FLOPs and bytes moved by one RL step, estimated for the roofline (docs/backpressure.md).

Pure: no torch, no I/O. The backend describes its model (`ModelCost`); the trainer counts the
step's tokens. Estimates, not measurements: they place a step on the roofline, nothing else.

- FLOPs: 2 N per sampled token (a forward pass: one multiply-add per parameter), and 4 N per
  trained token (forward, plus a backward that needs activation gradients only: the frozen
  weights get no weight gradient, and LoRA's are negligible).
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


@dataclass(frozen=True)
class StepCost:
    flops: float
    bytes_moved: float


def step_cost(model: ModelCost, prompt_lengths: list[int], completion_lengths: list[list[int]],
              trained_tokens: int, micro_batches: int) -> StepCost:
    """`completion_lengths[i]`: the completions of prompt i (one sampling call decodes them)."""
    sampled = sum(len(c) * p + sum(c) for p, c in zip(prompt_lengths, completion_lengths,
                                                      strict=True))
    flops = 2.0 * model.parameters * sampled + 4.0 * model.parameters * trained_tokens
    decode_steps = max((max(c, default=0) for c in completion_lengths), default=0)
    passes = 1 + decode_steps + 2 * max(micro_batches, 1 if trained_tokens else 0)
    cached = sum(n * p + n * (n - 1) / 2 for p, c in zip(prompt_lengths, completion_lengths,
                                                       strict=True) for n in c)
    return StepCost(flops=flops,
                    bytes_moved=float(model.weight_bytes) * passes
                    + float(model.kv_bytes_per_token) * cached)

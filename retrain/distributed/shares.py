"""How a call's work is split over ranks and its results joined again. Pure: no torch.

Each rank takes one contiguous block of the call's prompts (whole groups: a prompt's `n`
completions stay together) or datums; rank r's block is [r*n//world, (r+1)*n//world), so the
blocks differ by at most one item and the ranks' results, joined in rank order, are in the
order of the call."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from retrain.backends.base import LossOutput, SamplingParams


def blocks(n: int, world: int) -> list[range]:
    return [range(r * n // world, (r + 1) * n // world) for r in range(world)]


def split_params(params: SamplingParams, block: range) -> SamplingParams:
    """The params of one block of prompts: its prompts' own seeds."""
    seeds = params.prompt_seeds
    return params if seeds is None else replace(params, prompt_seeds=seeds[block.start:block.stop])


def shardable(params: SamplingParams) -> bool:
    """Whether any split of the prompts samples the same completions: each prompt keyed by its
    own seed, or greedy. A batch drawn from one seed is keyed by the prompts' places in it."""
    return params.prompt_seeds is not None or params.temperature == 0


# Metrics of a forward_backward share that are means over its loss tokens.
TOKEN_MEANS = ("clip_fraction", "ratio_mean", "ratio_truncated", "kl")


def joined_loss(parts: Sequence[LossOutput], tokens: Sequence[int]) -> LossOutput:
    """One call's output from its shares' (`tokens`: each share's loss tokens). The shares'
    losses are already over the whole call's normaliser, so they add up."""
    total = sum(tokens)
    metrics: dict[str, float] = {"tokens": float(total)}
    for key in TOKEN_MEANS:
        weighted = [(p.metrics[key], n) for p, n in zip(parts, tokens, strict=True)
                    if key in p.metrics and n]
        if weighted:
            metrics[key] = sum(v * n for v, n in weighted) / sum(n for _, n in weighted)
    peaks = [p.metrics["ratio_max"] for p in parts if "ratio_max" in p.metrics]
    if peaks:
        metrics["ratio_max"] = max(peaks)
    metrics.update(_gradients(parts))
    metrics["grad_diagnostics_s"] = max(p.metrics.get("grad_diagnostics_s", 0.0) for p in parts)
    return LossOutput(loss=sum(p.loss for p in parts),
                      logprobs=[lp for p in parts for lp in p.logprobs], metrics=metrics)


def _gradients(parts: Sequence[LossOutput]) -> dict[str, float]:
    """The micro-batch gradient measurements of every rank (training/diagnostics.py): their
    counts add; the small-batch figures are means over the micro-batches measured."""
    count = sum(p.metrics.get("grad_micro_batches", 0.0) for p in parts)
    measured = [p.metrics for p in parts if "grad_small_sq_norm" in p.metrics]
    out = {"grad_micro_batches": float(count)}
    if not measured:
        return out
    k = [m["grad_micro_batches"] for m in measured]
    out["grad_small_sq_norm"] = sum(m["grad_small_sq_norm"] * n
                                    for m, n in zip(measured, k, strict=True)) / sum(k)
    out["grad_small_tokens"] = sum(k) / sum(n / m["grad_small_tokens"]
                                            for m, n in zip(measured, k, strict=True))
    out["grad_coherence"] = sum(m["grad_coherence"] for m in measured) / len(measured)
    # The whole call's gradient, measured after the all-reduce (the same on every rank).
    out["grad_big_sq_norm"] = measured[0]["grad_big_sq_norm"]
    out["grad_big_tokens"] = float(sum(p.metrics.get("tokens", 0.0) for p in parts))
    return out

"""Backend datatypes <-> the tinker SDK's: datums, completions, stop tokens, the loss's config
and normaliser.

Pure conversions (numpy only); `types` is the SDK's `tinker.types`, passed in so that this
module does not import the SDK.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from retrain.algorithms import aggregation, losses
from retrain.algorithms.aggregation import Normaliser
from retrain.backends.base import BackendError, Completion, Datum, LossConfig


def loss_normaliser(datums: list[Datum], loss: LossConfig) -> Normaliser:
    """The call's normaliser (algorithms/aggregation.py): Tinker sums token losses, so each
    datum's advantages carry its factor, as tinker-cookbook folds normalisation in."""
    tokens = [sum(1 for m in d.mask if m > 0) for d in datums]
    return aggregation.normaliser(tokens, loss.aggregation, loss.max_tokens)


def wire_loss_config(loss: LossConfig) -> dict[str, float] | None:
    """Tinker's loss_fn_config for `loss` (its clip bounds), or a BackendError for a loss whose
    local update Tinker's inputs cannot express."""
    if loss.name not in losses.LOSSES:
        raise BackendError(losses.unknown_loss(loss.name))
    if loss.name == "dro":
        raise BackendError(f"loss 'dro': {losses.DRO_ON_TINKER}")
    if loss.name == "ppo" and loss.clip_ratio_c:
        raise BackendError("Tinker's ppo has no dual clip: set algorithm.clip_ratio_c = 0")
    if loss.name in losses.CLIPPED:
        lo, hi = loss.thresholds
        return {"clip_low_threshold": lo, "clip_high_threshold": hi}
    return None


def wire_datum(types: Any, d: Datum, scale: float, loss: str = "importance_sampling") -> Any:
    """The shifted datum on the wire: model_input = input tokens, inputs aligned to targets;
    the masked advantages times the datum's normaliser `scale` (cross_entropy: as weights)."""
    adv = np.asarray(d.advantages, dtype=np.float32) * np.asarray(d.mask, dtype=np.float32)
    adv = adv * np.float32(scale)
    inputs = {"target_tokens": np.asarray(d.target_tokens, dtype=np.int64)}
    if loss == "cross_entropy":
        inputs["weights"] = adv
    else:
        inputs |= {"logprobs": np.asarray(d.logprobs, dtype=np.float32), "advantages": adv}
    if loss == "gspo":
        inputs["sequence_ratio_mask"] = np.asarray(d.ratio_mask or d.mask, dtype=np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(list(d.input_tokens)),
                       loss_fn_inputs=inputs)


def stop_ids(tokenizer: Any) -> set[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        return {eos}
    return {int(e) for e in eos or []}


def completion_of(seq: Any, stop: set[int]) -> Completion:
    """Tokens up to and including the first stop token; nothing after it."""
    tokens = [int(t) for t in seq.tokens]
    logprobs = [float(x) for x in (seq.logprobs or [])]
    if len(logprobs) != len(tokens):
        raise BackendError(f"tinker sample returned {len(logprobs)} log-probs for "
                           f"{len(tokens)} tokens; the sampler must report every token's")
    for i, t in enumerate(tokens):
        if t in stop:
            return Completion(tokens[:i + 1], logprobs[:i + 1], "stop")
    reason = "stop" if seq.stop_reason == "stop" else "length"
    return Completion(tokens, logprobs, reason)

"""Backend datatypes <-> the tinker SDK's: datums, completions, stop tokens, loss scale.

Pure conversions (numpy only); `types` is the SDK's `tinker.types`, passed in so that this
module does not import the SDK.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from retrain.backends.base import BackendError, Completion, Datum


def advantage_scale(datums: list[Datum]) -> float:
    """Tinker's losses are sums over tokens, the local backend's a mean over the call's
    completion tokens: scaling the advantages by 1 / that count makes them the same loss."""
    tokens = sum(1 for d in datums for m in d.mask if m > 0)
    return 1.0 / tokens if tokens else 0.0


def wire_datum(types: Any, d: Datum, scale: float) -> Any:
    """The shifted datum on the wire: model_input = input tokens, inputs aligned to targets."""
    adv = np.asarray(d.advantages, dtype=np.float32) * np.asarray(d.mask, dtype=np.float32)
    return types.Datum(
        model_input=types.ModelInput.from_ints(list(d.input_tokens)),
        loss_fn_inputs={
            "target_tokens": np.asarray(d.target_tokens, dtype=np.int64),
            "logprobs": np.asarray(d.logprobs, dtype=np.float32),
            "advantages": adv * np.float32(scale),
        })


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

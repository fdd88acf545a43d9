"""The one place that checks what clients send, before any of it reaches the engine.

Every check answers a client mistake with a 400 that names the field and the allowed
range, so the SDK raises a BadRequestError at once instead of retrying a "server" error.
Limits come from the engine (`vocab_size`, `max_context`). Pure: no torch, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from retrain.backends.base import AdamParams, Datum, SamplingParams
from retrain.config.schema import MAX_LORA_RANK

MAX_SAMPLES = 4096          # completions per sample request
MAX_SEED = 2**63 - 1        # what torch and numpy generators take


class RequestError(ValueError):
    """A request field out of range; the message names the field (an HTTP 400)."""


def _finite(name: str, value: float) -> None:
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value!r}")


def _tokens(name: str, tokens: Iterable[int], vocab_size: int) -> None:
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"{name}: token id {bad} is outside the model's vocabulary "
                           f"(0..{vocab_size - 1})")


def check_lora_rank(rank: int) -> None:
    """A new training client's LoRA rank: the bound a config's model.lora_rank has."""
    if not 1 <= rank <= MAX_LORA_RANK:
        raise RequestError(f"lora_config.rank must be between 1 and {MAX_LORA_RANK}, "
                           f"got {rank}")


def check_sample(prompt: Sequence[int], num_samples: int, params: SamplingParams,
                 vocab_size: int, max_context: int | None) -> None:
    """A sample request: prompt, count and sampling knobs."""
    if not 1 <= num_samples <= MAX_SAMPLES:
        raise RequestError(f"num_samples must be between 1 and {MAX_SAMPLES}, "
                           f"got {num_samples}")
    _tokens("prompt", prompt, vocab_size)
    _tokens("SamplingParams.stop", params.stop_tokens, vocab_size)
    _finite("SamplingParams.temperature", params.temperature)
    if params.temperature < 0:
        raise RequestError("SamplingParams.temperature must be >= 0 (0 = greedy)")
    _finite("SamplingParams.top_p", params.top_p)
    if not 0 < params.top_p <= 1:
        raise RequestError(f"SamplingParams.top_p must be in (0, 1], got {params.top_p}")
    if params.top_k not in (-1, 0):
        raise RequestError("SamplingParams.top_k: top-k sampling is not supported by "
                           "retrain serve (use -1)")
    if params.seed is not None and not 0 <= params.seed <= MAX_SEED:
        raise RequestError(f"SamplingParams.seed must be between 0 and 2**63 - 1, "
                           f"got {params.seed}")
    if params.max_tokens < 1:
        raise RequestError("SamplingParams.max_tokens must be set (>= 1)")
    if max_context is not None and len(prompt) + params.max_tokens > max_context:
        raise RequestError(f"SamplingParams.max_tokens: prompt ({len(prompt)} tokens) + "
                           f"max_tokens ({params.max_tokens}) exceeds the model's context "
                           f"of {max_context} tokens")


def check_sample_extras(topk_prompt_logprobs: int, topk_sample_logprobs: int,
                        target_prompt_logprobs: object, prompt_alt_tokens_k: int) -> None:
    """Sample-request options the server does not compute: refused rather than ignored."""
    for name, value in (("topk_prompt_logprobs", topk_prompt_logprobs),
                        ("topk_sample_logprobs", topk_sample_logprobs),
                        ("prompt_alt_tokens_k", prompt_alt_tokens_k)):
        if value:
            raise RequestError(f"{name} is not supported by retrain serve (use 0)")
    if target_prompt_logprobs is not None:
        raise RequestError("target_prompt_logprobs is not supported by retrain serve")


FLOAT32_MAX = 3.4028234663852886e38


def check_adam(adam: AdamParams) -> None:
    """Optimizer settings of one optim_step."""
    for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        _finite(f"adam_params.{name}", getattr(adam, name))
    if adam.learning_rate < 0:
        raise RequestError(f"adam_params.learning_rate must be >= 0, got {adam.learning_rate}")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(adam, name) < 1:
            raise RequestError(f"adam_params.{name} must be in [0, 1), "
                               f"got {getattr(adam, name)}")
    if adam.eps <= 0:
        raise RequestError(f"adam_params.eps must be > 0, got {adam.eps}")
    if adam.weight_decay < 0 or adam.grad_clip_norm < 0:
        raise RequestError("adam_params.weight_decay and grad_clip_norm must be >= 0")
    if adam.learning_rate > FLOAT32_MAX:
        raise RequestError(f"adam_params.learning_rate = {adam.learning_rate:g} does not fit "
                           "the float32 weights")
    if adam.learning_rate * adam.weight_decay >= 1:
        raise RequestError("adam_params.learning_rate x weight_decay = "
                           f"{adam.learning_rate * adam.weight_decay:.3g} must be < 1: AdamW "
                           "multiplies every weight by 1 - lr x weight_decay, which then flips "
                           "and grows it until the weights diverge")


def check_datums(data: Sequence[Datum], config: dict[str, float], vocab_size: int,
                 max_context: int | None) -> None:
    """forward_backward data: token ids in the vocabulary, finite loss inputs and config."""
    for key, value in config.items():
        _finite(f"loss_fn_config[{key!r}]", value)
    if config.get("temperature", 1.0) <= 0:
        raise RequestError("loss_fn_config['temperature'] must be > 0")
    for i, d in enumerate(data):
        if len(d) == 0:
            raise RequestError(f"datum {i}: model_input is empty")
        if max_context is not None and len(d) > max_context:
            raise RequestError(f"datum {i}: {len(d)} tokens exceed the model's context of "
                               f"{max_context}")
        _tokens(f"datum {i}: model_input", d.input_tokens, vocab_size)
        _tokens(f"datum {i}: target_tokens", d.target_tokens, vocab_size)
        for name in ("logprobs", "advantages", "weights"):
            values = getattr(d, name) or []
            if not all(math.isfinite(v) for v in values):
                raise RequestError(f"datum {i}: loss_fn_inputs[{name!r}] holds NaN or "
                                   "infinite values")

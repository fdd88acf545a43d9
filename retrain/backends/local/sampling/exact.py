"""Batched sampling with a KV cache for the local backend (one decode loop for all completions).

A hand-written loop instead of `generate` so that the log-prob of every sampled token is taken
from exactly the distribution it was drawn from, before any truncation: `log_softmax` in
float32 of `logits / temperature`, the same computation `forward_backward` repeats. Other
choices that follow from owning the loop:
- each distinct prompt is prefilled once; its KV cache is then repeated for its `n` samples;
- the KV cache reserves room for prompt + max_tokens (`sampling.reserved_cache`): no copy per token;
- rows that reached EOS, a stop token or a stop string (`stop_strings.StopWatch`, asked
  after every token) leave the batch at the next host read, so finished completions cost
  nothing more: the host reads every step (`window` 1, the CPU's) or every `window` steps
  (CUDA's, `sampler_mode.EXACT_WINDOW`: the device is not stalled by a read per token; a
  row that ended is decoded on until the read, its extra tokens dropped there);
- a seeded `torch.Generator` drives sampling, so the global RNG is untouched; with one
  generator per prompt, a prompt's draws do not depend on what else shares the batch;
- every step draws one uniform for every row, finished or not, so a row's draws do not
  depend on when the others end: a stop string cuts a completion exactly where cutting the
  unstopped one afterwards would, and leaves the other rows' completions as they were.

`top_p < 1` samples from the renormalised nucleus, but the returned log-probs stay those of
the full tempered distribution (what the trainer recomputes): the ratio is exactly 1 before
an update, and the nucleus truncation is a sampling bias the ratio does not correct.
`temperature == 0` means greedy decoding (log-probs at temperature 1).
`params.top_logprobs = k` also keeps the k most likely tokens of that same distribution at
every position; `on_token` hears of each token as it is drawn (streaming in `retrain serve`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from functools import partial

import torch

from retrain.backends.base import (
    BackendError,
    Completion,
    SamplingParams,
    TokenIds,
    context_overflow,
)
from retrain.backends.local.sampling.exact_rows import OnToken, Rows, Window
from retrain.backends.local.sampling.reserved_cache import reserve
from retrain.backends.stop_strings import StopWatch
from retrain.errors import UserError


class SamplingStopped(BackendError):
    """The caller's `stop` said so between two decoding steps (its client is gone)."""


def eos_ids(model, tokenizer) -> set[int]:
    """The tokens that end a completion: the tokenizer's and the generation config's EOS
    (empty when neither defines one)."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return ids


def model_context(config) -> int | None:
    """Prompt + completion tokens a model takes (its position table), None when its config
    does not say."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_context(prompts: list[TokenIds], max_tokens: int, max_context: int | None) -> None:
    """BackendError before any compute when a prompt + max_tokens would run past the model's
    positions (silently wrong, or minutes of prefill, otherwise)."""
    for i, p in enumerate(prompts):
        why = context_overflow(len(p), max_tokens, max_context)
        if why:
            raise BackendError(f"sampling: prompt {i}: {why}")


def check_max_tokens(max_tokens: int, max_context: int | None, model_name: str) -> None:
    """UserError for `training.max_tokens` at or past the model's whole context, at start."""
    if max_context is not None and max_tokens >= max_context:
        raise UserError(f"training.max_tokens = {max_tokens}: model {model_name!r} takes "
                        f"{max_context} tokens in all (prompt and completion); give "
                        f"training.max_tokens below {max_context}")


def cache_keyword(model) -> str:
    """The name a model's forward takes its KV cache under: `cache` in transformers >= 5.2x
    (which deprecates `past_key_values`), `past_key_values` before."""
    import inspect

    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def left_pad(prompts: list[TokenIds], pad_id: int, device: torch.device):
    """Left-padded ids, attention mask and position ids (counting real tokens only)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


MIN_DIVISOR = 1e-30  # a float32 number: 1e-300 would round to 0 and give 0 / 0


def token_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs of the sampling distribution: float32 log_softmax of logits / temperature.
    The largest logit is subtracted before dividing (the same distribution), so a tiny
    temperature sends the others to -inf (probability 0) instead of overflowing to inf."""
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        if temperature < 1.0:
            logits = logits - logits.amax(dim=-1, keepdim=True)
        logits = logits / max(temperature, MIN_DIVISOR)
    return torch.log_softmax(logits, dim=-1)


def draw(logprobs: torch.Tensor, params: SamplingParams,
         generator: torch.Generator | list[torch.Generator] | torch.Tensor) -> torch.Tensor:
    """One token per row: greedy at temperature 0, else from the (nucleus of the) distribution.
    `generator` is one for all rows, one per row, or the rows' uniforms already drawn."""
    if params.temperature == 0:
        return logprobs.argmax(dim=-1)
    probs = logprobs.exp()
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly above each token
        drop = before >= params.top_p
        drop[..., 0] = False  # the top token stays: a top_p below float32's least is not 0
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    u = generator if isinstance(generator, torch.Tensor) else \
        uniforms(probs.shape[0], generator, probs.device)
    return inverse_cdf(probs, u)


def uniforms(rows: int, generator: torch.Generator | list[torch.Generator],
             device: torch.device) -> torch.Tensor:
    """One draw in (0, 1] per row, from the shared generator or each row's own."""
    if isinstance(generator, torch.Generator):
        u = torch.rand(rows, generator=generator, device=device, dtype=torch.float64)
    else:
        u = torch.cat([torch.rand(1, generator=g, device=device, dtype=torch.float64)
                       for g in generator])
    return 1.0 - u


def step_uniforms(total: int, n: int, generator: torch.Generator | list[torch.Generator],
                  device: torch.device) -> torch.Tensor:
    """This decoding step's uniform for each of the `total` rows, finished ones included:
    one `uniforms` call of all rows (a shared generator), or each prompt's `n` rows from its
    own generator. The same numbers as drawing row by row while no row has finished.
    A stream with its own `step_uniforms` (`counter_rng.CounterDraws`) gives them itself."""
    if hasattr(generator, "step_uniforms"):
        return generator.step_uniforms(total, device)
    if isinstance(generator, torch.Generator):
        return uniforms(total, generator, device)
    return torch.cat([uniforms(n, g, device) for g in generator])


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token whose cumulative probability first reaches u x the row's total: one uniform
    per row instead of one random number per vocabulary entry (what `multinomial` draws).
    u > 0, so a token of probability 0 is never drawn."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    target = (u * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


@torch.inference_mode()
def sample_batch(model, prompts: list[TokenIds], n: int, params: SamplingParams, *,
                 eos_ids: set[int], pad_id: int,
                 generator: torch.Generator | list[torch.Generator],
                 make_cache, cache_key: str = "past_key_values",
                 decode=None, decoder=None, on_token: OnToken | None = None,
                 stop: Callable[[], bool] | None = None,
                 leave: Callable[[], Collection[int]] | None = None,
                 window: int = 1) -> list[list[Completion]]:
    """`n` completions for each prompt, decoded together; see the module docstring.
    `generator`: one for the whole batch, or one per prompt (for its `n` rows); `cache_key`:
    see `cache_keyword`; `decode` (the tokenizer's) is needed for `params.stop_strings`;
    `decoder`: what runs a decoding step instead of `model` (e.g. its compiled forward);
    `on_token`: called with each completion's every token (index in the flat output);
    `stop`, asked before every decoding step: True ends the decode with SamplingStopped;
    `leave`, asked there too: completions (flat indexes) that leave the batch as they are;
    `window`: decoding steps between two host reads (`exact_rows.Window`; 1 = every step).
    A prompt + max_tokens beyond the model's context is a BackendError (`check_context`)."""
    check_context(prompts, params.max_tokens, model_context(model.config))
    device = next(model.parameters()).device
    cache, mask, logits = _prefill(model, prompts, n, params.max_tokens, pad_id, make_cache,
                                   cache_key)
    total = len(prompts) * n
    rows = Rows.empty(total, params.top_logprobs > 0)
    active = torch.arange(total, device=device)  # batch row -> completion index
    read = partial(_read, rows=rows, ends=set(eos_ids) | set(params.stop_tokens),
                   watch=_stop_watch(params, decode), on_token=on_token)
    steps = Window(params.top_logprobs)
    for step in range(params.max_tokens):
        if stop is not None and stop():
            raise SamplingStopped(f"sampling stopped after {step} of {params.max_tokens} "
                                  "tokens")
        if leave is not None and (gone := leave()):
            if len(steps):  # the steps not read yet first: rows may have ended in them
                kept = read(steps, active, cache, mask, logits)
                if kept is None:
                    break
                active, mask, logits = kept
            active, mask, logits = _leave(gone, cache, active, mask, logits)
        lp = token_logprobs(logits, params.temperature)
        u = None if params.temperature == 0 else \
            step_uniforms(total, n, generator, device)[active]
        tok = draw(lp, params, u)
        steps.add(lp, tok)
        if len(steps) == window or step == params.max_tokens - 1:
            kept = read(steps, active, cache, mask, tok)
            if step == params.max_tokens - 1 or not kept:
                break
            active, mask, tok = kept
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        positions = mask.sum(dim=1, keepdim=True) - 1
        out = (model if decoder is None else decoder)(
            input_ids=tok[:, None], attention_mask=mask, position_ids=positions,
            **{cache_key: cache}, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1]
    return rows.completions(n, len(prompts))


def _read(steps: Window, active: torch.Tensor, cache, mask: torch.Tensor, last: torch.Tensor,
          *, rows: Rows, ends: set[int], watch: StopWatch, on_token: OnToken | None):
    """Read the window back into `rows`; the batch without the rows that ended (their cache
    rows, masks and `last`, the per-row tensor fed next), or None when none goes on."""
    ended = steps.read(rows, active.tolist(), ends, watch, on_token)
    if all(ended):
        return None
    if any(ended):
        keep = torch.tensor([i for i, e in enumerate(ended) if not e], device=active.device)
        cache.batch_select_indices(keep)
        active, mask, last = active[keep], mask[keep], last[keep]
    return active, mask, last

def _leave(gone: Collection[int], cache, active: torch.Tensor, mask: torch.Tensor,
           logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch without the rows of the completions in `gone` (SamplingStopped when none
    stays): their cache rows, attention masks and next-token logits dropped."""
    stay = ~torch.isin(active, torch.tensor(sorted(gone), device=active.device))
    if not bool(stay.any()):
        raise SamplingStopped("every completion left the batch")
    if bool(stay.all()):
        return active, mask, logits
    keep = stay.nonzero().squeeze(-1)
    cache.batch_select_indices(keep)
    return active[keep], mask[keep], logits[keep]


def _prefill(model, prompts: list[TokenIds], n: int, max_tokens: int, pad_id: int, make_cache,
             cache_key: str):
    """Each distinct prompt once, its cache and last logits repeated for its `n` rows."""
    ids, mask, positions = left_pad(prompts, pad_id, next(model.parameters()).device)
    cache = reserve(make_cache(), ids.shape[1] + max_tokens)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                **{cache_key: cache}, use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1]
    if n > 1:
        cache.batch_repeat_interleave(n)
        mask = mask.repeat_interleave(n, dim=0)
        logits = logits.repeat_interleave(n, dim=0)
    return cache, mask, logits


def _stop_watch(params: SamplingParams, decode) -> StopWatch:
    if params.stop_strings and decode is None:
        raise ValueError("sample_batch: stop_strings need the tokenizer's decode")
    return StopWatch(params.stop_strings, decode)

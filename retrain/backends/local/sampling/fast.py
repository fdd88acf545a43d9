"""`[backend] sampler = "fast"`: decoding on a static KV cache, `k` device steps per host look.

The exact sampler (`sampling.exact.sample_batch`) reads every step's tokens back to the host
to decide which rows go on; on a GPU that read serialises the device and makes a step cost
its kernel launches. This one:
- prefills as the exact sampler does (each distinct prompt once) and copies each prompt's
  KV cache to its samples' rows of a static cache (`sampling.static_cache`);
- runs `check_every` decoding steps (`decode_step.step`, a CUDA graph replay on CUDA) that
  write each token and its log-prob into device buffers, then reads those steps back once:
  EOS, stop tokens and stop strings are found there, per row, in order, and a row keeps
  nothing after the token that ended it (at most `check_every - 1` steps are wasted on it);
- draws from `counter_rng` (u = f(seed, prompt, sample, step)), so a row's tokens do not
  depend on the batch it shares, nor on when the other rows end;
- compacts the live rows into the next smaller bucket once they fit it;
- keeps its static states within a share of the free device memory
  (`static_cache.CACHE_SHARE`), decoding in several passes of whole prompts when all the rows
  do not fit at once (the same completions: a row's draws are its own);
- ends each prompt's rows at its own length limit when given one (`limits`).

With the same draws it gives the exact sampler's tokens and log-probs (float rounding
aside: tests/backends/local/sampling/test_static_sampler.py). The draw stream differs from the
exact sampler's `torch.Generator` streams, so the same seed gives other completions than `exact`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from retrain.backends.base import BackendOOMError, Completion, SamplingParams, TokenIds
from retrain.backends.local.sampling import counter_rng, cuda_graphs, decode_step
from retrain.backends.local.sampling.exact import left_pad
from retrain.backends.local.sampling.fast_rows import Rows
from retrain.backends.local.sampling.merged import MergedWeights, mergeable
from retrain.backends.local.sampling.static_cache import (
    CACHE_SHARE,
    CAPACITY_STEP,
    StatePool,
    StaticState,
    bucket_for,
    capacity_for,
    compact,
    device_free_bytes,
)
from retrain.backends.stop_strings import StopWatch

CHECK_EVERY = 16


def unsupported(net: Any, base: Any) -> str | None:
    """Why the fast sampler cannot run this model (None when it can)."""
    return decode_step.unsupported(base) or mergeable(net)


class StaticSampler:
    """The fast sampler of one model: its static states, merged weights and CUDA graphs.
    `merged`: sample from LoRA merged into buffers (the `fast` mode) instead of peft's
    layers; `graphs`: capture steps (CUDA only; None = where available).

    Attention reads a window of the cache: with graphs, the filled columns rounded up to
    CAPACITY_STEP (a few shapes to capture); without, exactly the filled columns (masked
    columns add exact zeros, but in another summation order: the last bits would differ
    from the exact sampler's)."""

    def __init__(self, base: Any, device: torch.device, *, merged: bool = True,
                 graphs: bool | None = None, check_every: int = CHECK_EVERY):
        self.base = base
        self.arch = decode_step.arch_of(base)
        self.device = device
        self.merged = merged
        self.check_every = check_every
        use = cuda_graphs.available(device) if graphs is None else graphs
        self.graphs = cuda_graphs.StepGraphs() if use else None
        self.window_step = CAPACITY_STEP if use else 1
        self.free_bytes = None  # free memory by device for the cache pool (None: the device's)
        self.compactions = 0
        self.pool: StatePool | None = None
        self.weights: dict[str, MergedWeights] = {}
        self._fingerprint = self._addresses()

    def _addresses(self) -> tuple[int, ...]:
        """Where every parameter of the model lives: a weight replaced (a reloaded model) or
        a module wrapped (peft adding an adapter on `lm_head`) changes it."""
        return tuple(p.data_ptr() for p in self.base.parameters())

    def linear_for(self, net: Any, adapter: str | None):
        """What runs a projection for `adapter`: its merged buffers (refreshed if the
        adapter changed) or the peft layers themselves."""
        if not self.merged or adapter is None:
            return decode_step._plain
        w = self.weights.get(adapter)
        if w is None:
            w = self.weights[adapter] = MergedWeights(net, adapter)
        w.refresh()
        return w.linear

    def forget(self, adapter: str) -> None:
        """Drop an adapter's merged buffers and graphs (it was deleted)."""
        self.weights.pop(adapter, None)
        if self.graphs is not None:
            self.graphs.drop(lambda key: key[0] == adapter)

    @torch.no_grad()
    def sample(self, net: Any, adapter: str | None, prompts: list[TokenIds], n: int,
               params: SamplingParams, *, seeds: list[int], prompt_ids: list[int],
               eos_ids: set[int], pad_id: int, make_cache, cache_key: str,
               decode=None, limits: list[int] | None = None) -> list[list[Completion]]:
        """`n` completions per prompt; prompt p's sample j draws from key (seeds[p],
        prompt_ids[p], j). `net` runs the prefill with `adapter` already active.
        `limits`: each prompt's own most tokens (at most params.max_tokens; None: that).
        Prompts whose rows the KV cache budget does not hold at once are decoded in several
        passes (`_passes`): the same completions, since a row's draws are its own."""
        self._check_addresses()
        linear = self.linear_for(net, adapter)
        if params.stop_strings and decode is None:
            raise ValueError("sample: stop_strings need the tokenizer's decode")
        ends, out = set(eos_ids) | set(params.stop_tokens), []
        for part in self._passes(prompts, n, params):
            own = None if limits is None else [min(limits[p], params.max_tokens)
                                              for p in part for _ in range(n)]
            rows = Rows(len(part) * n, ends, StopWatch(params.stop_strings, decode), own)
            steps = replace(params, max_tokens=max(own) if own else params.max_tokens)
            st, width = self._prefill(net, [prompts[p] for p in part], n, steps,
                                      [seeds[p] for p in part], [prompt_ids[p] for p in part],
                                      pad_id, make_cache, cache_key)
            self._decode(st, width, rows, steps, linear, adapter)
            out += rows.completions(n)
        return out

    def _passes(self, prompts: list[TokenIds], n: int,
                params: SamplingParams) -> list[list[int]]:
        """The prompts (by index) decoded together: all of them, or as many as the cache
        budget's largest bucket holds at a time."""
        if self.pool is None:
            dtype = self.base.get_input_embeddings().weight.dtype
            self.pool = StatePool(decode_step.geometry(self.arch, dtype, self.device),
                                  lambda: (self.free_bytes or device_free_bytes)(self.device))
        capacity = capacity_for(max(len(p) for p in prompts), params.max_tokens)
        most = self.pool.max_bucket(capacity)
        if most is None or most >= len(prompts) * n:
            return [list(range(len(prompts)))]
        if most < n:
            need = self.pool.geo.state_bytes(bucket_for(n), capacity)
            raise BackendOOMError(f"sampling: {n} samples of {capacity} positions need a KV "
                                  f"cache of {need / 2**30:.2f} GiB, more than the "
                                  f"{CACHE_SHARE:.0%} of free device memory the sampler "
                                  f"takes ({(self.pool.budget() or 0) / 2**30:.2f} GiB)")
        per = most // n
        return [list(range(i, min(i + per, len(prompts)))) for i in range(0, len(prompts), per)]

    def _check_addresses(self) -> None:
        now = self._addresses()
        if now != self._fingerprint:  # weights replaced or modules wrapped, not updated in place
            self._fingerprint = now
            self.arch = decode_step.arch_of(self.base)
            self.weights.clear()
            self.pool = None  # its dtype may have changed too
            if self.graphs is not None:
                self.graphs.clear()

    def _prefill(self, net, prompts, n, params, seeds, prompt_ids, pad_id, make_cache,
                 cache_key) -> tuple[StaticState, int]:
        """Prefill each prompt once and load its cache into its rows; step 0 is drawn."""
        ids, mask, positions = left_pad(prompts, pad_id, self.device)
        cache = make_cache()
        out = net(input_ids=ids, attention_mask=mask, position_ids=positions,
                  **{cache_key: cache}, use_cache=True, logits_to_keep=1)
        total = len(prompts) * n
        bucket, width = bucket_for(total), ids.shape[1]
        keys = [layer.keys for layer in cache.layers]
        values = [layer.values for layer in cache.layers]
        st = self._state(bucket, capacity_for(width, params.max_tokens))
        pad = bucket - total
        rows = torch.arange(total, device=self.device) // n
        rows = torch.cat([rows, rows[:1].expand(pad)])
        st.fill(keys, values, mask, rows)
        row_keys = counter_rng.row_keys(seeds, prompt_ids, n, self.device)
        st.keys.copy_(torch.cat([row_keys, row_keys[:1].expand(pad, 2)]))
        if params.temperature > 0:  # every step's draws at once: a step reads its column
            st.u[:, :params.max_tokens].copy_(counter_rng.uniforms_block(st.keys,
                                                                         params.max_tokens))
        decode_step.emit(st, out.logits[:, -1][rows], params)
        return st, width

    def _state(self, bucket: int, capacity: int) -> StaticState:
        st = self.pool.get(bucket, capacity)
        if self.pool.dropped and self.graphs is not None:
            gone = set(self.pool.dropped)
            self.graphs.drop(lambda key: (key[1], key[2]) in gone)
        self.pool.dropped.clear()
        return st

    def _decode(self, st: StaticState, width: int, rows: Rows, params: SamplingParams,
                linear, adapter: str | None) -> None:
        done, start = 1, 0  # steps drawn; the first not yet read back
        while True:
            if done - start == self.check_every or done == params.max_tokens:
                rows.collect(st.out_tok[:, start:done], st.out_lp[:, start:done])
                start = done
                if not rows.live or done == params.max_tokens:
                    return
                st = self._shrink(st, rows)
                continue
            step = self.window_step
            window = min(st.capacity, -(-(width + done) // step) * step)
            self._step(st, params, window, linear, adapter)
            done += 1

    def _step(self, st: StaticState, params: SamplingParams, window: int, linear,
              adapter: str | None) -> None:
        def run() -> None:
            decode_step.step(self.arch, st, params, window, linear)

        if self.graphs is None:
            run()
            return
        key = (adapter, st.bucket, st.capacity, window, params.temperature, params.top_p,
               self.merged)
        self.graphs.run(key, run)

    def _shrink(self, st: StaticState, rows: Rows) -> StaticState:
        """The live rows, compacted into the smallest bucket that holds them."""
        bucket = bucket_for(len(rows.live))
        if bucket >= st.bucket:
            return st
        small = self._state(bucket, st.capacity)
        compact(st, small, rows.moved().to(self.device))
        self.compactions += 1
        return small

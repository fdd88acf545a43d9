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
- compacts the live rows into the next smaller bucket once they fit it.

With the same draws it gives the exact sampler's tokens and log-probs (float rounding
aside: tests/test_static_sampler.py). The draw stream differs from the exact sampler's
`torch.Generator` streams, so the same seed gives other completions than `exact`.
"""

from __future__ import annotations

from typing import Any

import torch

from retrain.backends.base import Completion, DivergedError, SamplingParams, TokenIds
from retrain.backends.local.sampling import counter_rng, cuda_graphs, decode_step
from retrain.backends.local.sampling.exact import left_pad
from retrain.backends.local.sampling.merged import MergedWeights, mergeable
from retrain.backends.local.sampling.static_cache import (
    CAPACITY_STEP,
    StatePool,
    StaticState,
    bucket_for,
    capacity_for,
    compact,
)
from retrain.backends.stop_strings import StopWatch

CHECK_EVERY = 16


def unsupported(net: Any, base: Any) -> str | None:
    """Why the fast sampler cannot run this model (None when it can)."""
    return decode_step.unsupported(base) or mergeable(net)


class _Rows:
    """Host side of a decode: each completion's tokens, log-probs, finish, and which live
    completion sits in which slot of the static state."""

    def __init__(self, total: int, ends: set[int], watch: StopWatch):
        self.tokens: list[list[int]] = [[] for _ in range(total)]
        self.logprobs: list[list[float]] = [[] for _ in range(total)]
        self.stopped = [False] * total
        self.live = [(row, row) for row in range(total)]  # (slot, completion) still going
        self.ends, self.watch = ends, watch

    def collect(self, toks: list[list[int]], lps: list[list[float]]) -> None:
        """Take the steps just read back (`toks[slot]`); rows that ended leave `live`."""
        self.live = [(slot, row) for slot, row in self.live
                     if not self._take(row, toks[slot], lps[slot])]

    def moved(self) -> torch.Tensor:
        """The live rows' slots, which now become slots 0, 1, ... (a compaction)."""
        slots = [slot for slot, _ in self.live]
        self.live = [(i, row) for i, (_, row) in enumerate(self.live)]
        return torch.tensor(slots, dtype=torch.long)

    def _take(self, row: int, toks: list[int], lps: list[float]) -> bool:
        tokens, logprobs = self.tokens[row], self.logprobs[row]
        for t, lp in zip(toks, lps, strict=True):
            if not -float("inf") < lp < float("inf"):
                raise DivergedError("sampling: the next-token probabilities are not finite "
                                    "(NaN or infinite logits): the weights diverged",
                                    sampling=True)
            tokens.append(t)
            logprobs.append(lp)
            if t in self.ends or (self.watch and self.watch.hit(tokens)):
                self.stopped[row] = True
                return True
        return False

    def completions(self, n: int) -> list[list[Completion]]:
        flat = [Completion(tokens=t, logprobs=lp, finish_reason="stop" if s else "length")
                for t, lp, s in zip(self.tokens, self.logprobs, self.stopped, strict=True)]
        return [flat[i:i + n] for i in range(0, len(flat), n)]


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
               decode=None) -> list[list[Completion]]:
        """`n` completions per prompt; prompt p's sample j draws from key (seeds[p],
        prompt_ids[p], j). `net` runs the prefill with `adapter` already active."""
        self._check_addresses()
        linear = self.linear_for(net, adapter)
        if params.stop_strings and decode is None:
            raise ValueError("sample: stop_strings need the tokenizer's decode")
        rows = _Rows(len(prompts) * n, set(eos_ids) | set(params.stop_tokens),
                     StopWatch(params.stop_strings, decode))
        st, width = self._prefill(net, prompts, n, params, seeds, prompt_ids, pad_id,
                                  make_cache, cache_key)
        self._decode(st, width, rows, params, linear, adapter)
        return rows.completions(n)

    def _check_addresses(self) -> None:
        now = self._addresses()
        if now != self._fingerprint:  # weights replaced or modules wrapped, not updated in place
            self._fingerprint = now
            self.arch = decode_step.arch_of(self.base)
            self.weights.clear()
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
        if self.pool is None:
            self.pool = StatePool(decode_step.geometry(self.arch, keys[0].dtype, self.device))
        st = self._state(bucket, capacity_for(width, params.max_tokens))
        pad = bucket - total
        rows = torch.arange(total, device=self.device) // n
        rows = torch.cat([rows, rows[:1].expand(pad)])
        st.fill(keys, values, mask, rows)
        row_keys = counter_rng.row_keys(seeds, prompt_ids, n, self.device)
        st.keys.copy_(torch.cat([row_keys, row_keys[:1].expand(pad, 2)]))
        decode_step.emit(st, out.logits[:, -1][rows], params)
        return st, width

    def _state(self, bucket: int, capacity: int) -> StaticState:
        st = self.pool.get(bucket, capacity)
        if self.pool.dropped and self.graphs is not None:
            gone = set(self.pool.dropped)
            self.graphs.drop(lambda key: (key[1], key[2]) in gone)
        self.pool.dropped.clear()
        return st

    def _decode(self, st: StaticState, width: int, rows: _Rows, params: SamplingParams,
                linear, adapter: str | None) -> None:
        done, start = 1, 0  # steps drawn; the first not yet read back
        while True:
            if done - start == self.check_every or done == params.max_tokens:
                toks = st.out_tok[:, start:done].tolist()
                lps = st.out_lp[:, start:done].tolist()
                rows.collect(toks, lps)
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

    def _shrink(self, st: StaticState, rows: _Rows) -> StaticState:
        """The live rows, compacted into the smallest bucket that holds them."""
        bucket = bucket_for(len(rows.live))
        if bucket >= st.bucket:
            return st
        small = self._state(bucket, st.capacity)
        compact(st, small, rows.moved().to(self.device))
        self.compactions += 1
        return small

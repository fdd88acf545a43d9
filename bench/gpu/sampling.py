"""bench/gpu/main.py's sampling measurements: the exact sampler against the fast one, two
yardsticks, where a decoding step's time goes, and how close the fast sampler's numbers are to
the exact ones and to the trainer's.

Per model (`measure`), in this order, each skipped once the model's time share is spent (so
one command stays within its minutes; a skip is reported, never silent):
- decode tokens/s on fixed shapes: batch 64/256/512/1024 (groups of 8), 128-token prompts,
  256 new tokens, EOS ignored; the fast sampler (merged LoRA, CUDA graphs) median of 3 after
  a warm-up, the exact one (its CUDA window of 16 steps per host read) at 64 and 256 with one
  repeat after a short warm-up, and today's one-step loop at 256 on the first model;
- nano-vllm's bench recipe (Qwen shapes): 256 sequences, prompt and output lengths uniform in
  [100, 1024] (seeded), EOS ignored, prefill included, one timed run after an identical
  warm-up: output tokens / seconds, the figure vLLM's is published as;
- the static path through the unmerged adapter against today's loop with the same counter
  draws (share of identical completions, log-prob gap), and the fast sampler's log-probs
  against the trainer's forward of the same tokens (gap, mismatch KL = mean r - log r - 1);
- with `--profile`: torch.profiler over a fast decode at batch 256, the top kernels by device
  time and the device's idle gaps per decoding step (the host's share of a step).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from retrain.backends.base import SamplingParams, make_datum
from retrain.backends.local.sampling.counter_rng import CounterDraws
from retrain.backends.local.sampling.exact import sample_batch
from retrain.backends.local.sampling.fast import StaticSampler

# vLLM 0.10.2 on one A800 with nano-vllm's recipe (output tok/s; ../shared/notes/gpu.md)
VLLM_A800 = {"qwen2.5-0.5b": 17_700, "qwen3-0.6b": 8_600}


@dataclass
class SamplingPlan:
    batches: tuple[int, ...] = (64, 256, 512, 1024)   # the fast sampler's
    exact_batches: tuple[int, ...] = (64, 256)
    one_step_batch: int = 256        # today's loop (window 1), on the first model only
    nano_sequences: int = 256
    nano_lengths: tuple[int, int] = (100, 1024)
    nano_models: tuple[str, ...] = ("qwen2.5-0.5b", "qwen3-0.6b")
    check_batch: int = 32            # the exactness and mismatch checks
    profile_batch: int = 256
    profile_tokens: int = 32
    seconds: float = 80.0            # each model's share of the command's time


SMOKE_SAMPLING = SamplingPlan(batches=(4, 8), exact_batches=(4, 8), one_step_batch=8,
                              nano_sequences=4, nano_lengths=(4, 12),
                              nano_models=("tiny", "tiny-qwen3"), check_batch=4,
                              profile_batch=4, profile_tokens=4, seconds=120.0)


def sync(plan) -> None:
    if plan.device == "cuda":
        torch.cuda.synchronize()


def prompts_for(count: int, plan, vocab: int, seed: int, length: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length or plan.prompt_len), generator=gen).tolist()


def net_of(backend):
    backend.model.activate(backend.adapter)
    return backend.model.net.eval()


def common(backend) -> dict:
    m = backend.model
    return {"eos_ids": set(), "pad_id": m.pad_id, "make_cache": backend._make_cache,
            "cache_key": m.cache_key}


def eager(backend, prompts, params, plan, draws=None, window: int | None = None):
    """The exact sampler (EOS ignored), with torch.Generator draws or `draws`, reading the
    host every `window` steps (None: the device's default)."""
    gen = draws or torch.Generator(backend.model.device).manual_seed(0)
    return sample_batch(net_of(backend), prompts, plan.group, params, generator=gen,
                        window=window or backend.model.exact_window, **common(backend))


def fast(sampler: StaticSampler, backend, prompts, params, plan, seed=0, n=None,
         limits=None):
    return sampler.sample(net_of(backend), backend.adapter, prompts, n or plan.group, params,
                          seeds=[seed] * len(prompts), prompt_ids=list(range(len(prompts))),
                          limits=limits, **common(backend))


def timed(run, plan, repeats: int, warm=None) -> float:
    """Median seconds of `repeats` runs after one warm-up (`warm`, else `run` itself)."""
    (warm or run)()
    times = []
    for _ in range(repeats):
        sync(plan)
        t0 = time.perf_counter()
        run()
        sync(plan)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Share:
    """A model's time share: `run` a measurement while time is left, else say it skipped."""

    def __init__(self, seconds: float):
        self.deadline = time.perf_counter() + seconds

    def run(self, fn, *args) -> Any:
        if time.perf_counter() > self.deadline:
            return {"skipped": "the model's time share was spent"}
        return fn(*args)


def decode_row(backend, sampler, plan, batch: int, exact: bool, one_step: bool) -> dict:
    """Tokens/s of one fixed shape: fast, and (if asked) exact and today's one-step loop."""
    params = SamplingParams(max_tokens=plan.new_tokens, temperature=1.0)
    short = replace(params, max_tokens=min(8, params.max_tokens))
    prompts = prompts_for(batch // plan.group, plan, backend.model.vocab_size, seed=batch)
    tokens = batch * plan.new_tokens
    f = timed(lambda: fast(sampler, backend, prompts, params, plan), plan, plan.repeats)
    row = {"batch": batch, "fast_tok_s": tokens / f, "eager_tok_s": None, "speedup": None}
    if exact:
        e = timed(lambda: eager(backend, prompts, params, plan), plan, 1,
                  warm=lambda: eager(backend, prompts, short, plan))
        row.update(eager_tok_s=tokens / e, speedup=e / f)
    if one_step:
        e1 = timed(lambda: eager(backend, prompts, params, plan, window=1), plan, 1,
                   warm=lambda: eager(backend, prompts, short, plan, window=1))
        row["one_step_tok_s"] = tokens / e1
    return row


def nano_recipe(backend, sampler, plan, splan: SamplingPlan) -> dict:
    """nano-vllm's bench: `nano_sequences` prompts of random lengths and tokens, each with its
    own random output length, one sample each, EOS ignored, prefill included."""
    gen = torch.Generator().manual_seed(0)
    lo, hi = splan.nano_lengths
    count = splan.nano_sequences
    lengths = torch.randint(lo, hi + 1, (count,), generator=gen).tolist()
    outputs = torch.randint(lo, hi + 1, (count,), generator=gen).tolist()
    vocab = backend.model.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(max_tokens=max(outputs), temperature=0.6)

    got = []

    def run():
        got[:] = fast(sampler, backend, prompts, params, plan, n=1, limits=outputs)

    seconds = timed(run, plan, 1)
    got = sum(len(c.tokens) for g in got for c in g)
    return {"sequences": count, "prompt_tokens": sum(lengths), "output_tokens": sum(outputs),
            "seconds": seconds, "tok_s": sum(outputs) / seconds, "all_tokens": got ==
            sum(outputs), "vllm_a800_tok_s": VLLM_A800.get(backend.model.name_or_path)}


def gaps(a, b) -> tuple[float, list[float]]:
    """Share of completions with the same tokens; |log-prob differences| over the common
    prefix of each pair."""
    same, diffs = 0, []
    for ga, gb in zip(a, b, strict=True):
        for ca, cb in zip(ga, gb, strict=True):
            same += ca.tokens == cb.tokens
            for ta, tb, la, lb in zip(ca.tokens, cb.tokens, ca.logprobs, cb.logprobs,
                                      strict=False):
                if ta != tb:
                    break
                diffs.append(abs(la - lb))
    return same / sum(len(g) for g in a), diffs


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def exactness(backend, plan, splan: SamplingPlan) -> dict:
    """The static path (unmerged adapter) against today's loop with the same draws."""
    params = SamplingParams(max_tokens=plan.new_tokens, temperature=1.0)
    prompts = prompts_for(splan.check_batch // plan.group, plan, backend.model.vocab_size, 7)
    ids = list(range(len(prompts)))
    ref = eager(backend, prompts, params, plan,
                CounterDraws([0] * len(prompts), ids, plan.group, backend.model.device))
    static = StaticSampler(backend.model.base, backend.model.device, merged=False)
    same, diffs = gaps(ref, fast(static, backend, prompts, params, plan))
    return {"same_completions": same, "logprob_gap_p95": pct(diffs, 0.95),
            "logprob_gap_max": max(diffs, default=0.0)}


def mismatch(backend, plan, splan: SamplingPlan, sampler: StaticSampler) -> dict:
    """The fast sampler's log-probs against the trainer's forward of the same tokens."""
    params = SamplingParams(max_tokens=plan.new_tokens, temperature=1.0)
    prompts = prompts_for(splan.check_batch // plan.group, plan, backend.model.vocab_size, 8)
    groups = fast(sampler, backend, prompts, params, plan, seed=3)
    datums = [make_datum(p, c, 0.0) for p, g in zip(prompts, groups, strict=True) for c in g]
    log_r, diffs = [], []
    for d, lp in zip(datums, backend.logprobs(datums), strict=True):
        for m, s, t in zip(d.mask, d.logprobs, lp, strict=True):
            if m > 0:
                log_r.append(t - s)
                diffs.append(abs(t - s))
    kl = statistics.fmean(math.exp(x) - x - 1.0 for x in log_r)
    return {"logprob_gap_p50": pct(diffs, 0.5), "logprob_gap_p95": pct(diffs, 0.95),
            "logprob_gap_max": max(diffs), "mismatch_kl": kl}


def graph_after_adamw(backend, plan) -> dict:
    """Graphs captured before an AdamW step and replayed after it give the eager steps'
    tokens and log-probs (the merged buffers were refreshed in place)."""
    from retrain.backends.base import AdamParams, LossConfig

    if plan.device != "cuda":
        return {"skipped": "no CUDA: graphs capture only there"}
    params = SamplingParams(max_tokens=48, temperature=0.0)
    prompts = prompts_for(4, plan, backend.model.vocab_size, seed=10)
    graphed = StaticSampler(backend.model.base, backend.model.device, merged=True)
    before = fast(graphed, backend, prompts, params, plan)
    captures = graphed.graphs.captures
    datums = [make_datum(p, c, 1.0) for p, g in zip(prompts, before, strict=True) for c in g]
    backend.forward_backward(datums, LossConfig())
    backend.optim_step(AdamParams(learning_rate=1e-2))
    after = fast(graphed, backend, prompts, params, plan)
    plain = StaticSampler(backend.model.base, backend.model.device, merged=True, graphs=False)
    plain.window_step = graphed.window_step
    same, diffs = gaps(after, fast(plain, backend, prompts, params, plan))
    moved, _ = gaps(before, after)
    return {"recaptured": graphed.graphs.captures - captures, "replays": graphed.graphs.replays,
            "same_completions": same, "logprob_gap_max": max(diffs, default=0.0),
            "changed_by_the_step": 1.0 - moved}


def measure(backend, name: str, plan, splan: SamplingPlan, first: bool,
            profile: Callable | None = None) -> dict:
    """Every sampling measurement of one model, within its time share; `profile`
    (gpu_profile.profile_decode, with --profile) adds the decode step's kernel table."""
    share = Share(splan.seconds)
    sampler = StaticSampler(backend.model.base, backend.model.device, merged=True)
    order = sorted(splan.batches, key=lambda b: (b != 256, b != 64, b))  # targets first
    rows = [share.run(decode_row, backend, sampler, plan, b, b in splan.exact_batches,
                      first and b == splan.one_step_batch) for b in order]
    out = {"decode": sorted([r for r in rows if "batch" in r], key=lambda r: r["batch"]),
           "decode_skipped": [b for b, r in zip(order, rows, strict=True) if "batch" not in r]}
    if name in splan.nano_models:
        out["nano_vllm_recipe"] = share.run(nano_recipe, backend, sampler, plan, splan)
    out["exact"] = share.run(exactness, backend, plan, splan)
    out["fast"] = share.run(mismatch, backend, plan, splan, sampler)
    if profile is not None:
        out["profile"] = share.run(profile, backend, sampler, plan, splan)
    sampler.pool = None  # its KV buffers go before the next measurement
    if plan.device == "cuda":
        torch.cuda.empty_cache()
    return out


def tables(models: dict) -> str:
    """The sampling tables of bench/gpu/main.py's report, as markdown."""
    lines = ["| model | batch | exact tok/s | fast tok/s | exact / fast | one-step exact "
             "tok/s |", "|---|---|---|---|---|---|"]
    for name, r in models.items():
        for d in r["decode"]:
            e, one = d["eager_tok_s"], d.get("one_step_tok_s")
            ratio = "-" if e is None else f"{1 / d['speedup']:.2f}"
            lines.append(f"| {name} | {d['batch']} | {_n(e)} | {d['fast_tok_s']:,.0f} | "
                         f"{ratio} | {_n(one)} |")
        if r.get("decode_skipped"):
            lines.append(f"| {name} | {r['decode_skipped']} | skipped: time share | | | |")
    nano = {k: r["nano_vllm_recipe"] for k, r in models.items() if "nano_vllm_recipe" in r}
    if nano:
        lines += ["", "| nano-vllm recipe | sequences | prompt / output tokens | s | output "
                  "tok/s | vLLM on an A800 |", "|---|---|---|---|---|---|"]
        for name, n in nano.items():
            lines.append(f"| {name} | skipped | | | | |" if "skipped" in n else
                         f"| {name} | {n['sequences']} | {n['prompt_tokens']:,} / "
                         f"{n['output_tokens']:,} | {n['seconds']:.1f} | {n['tok_s']:,.0f} | "
                         f"{_n(n['vllm_a800_tok_s'])} |")
    lines += ["", "| model | exact: same completions, lp gap p95 / max | fast: lp gap p95 / "
              "max, mismatch KL |", "|---|---|---|"]
    for name, r in models.items():
        e, f = r["exact"], r["fast"]
        lines.append(f"| {name} | {_check(e, 'same_completions')} | {_check(f, 'mismatch_kl')} |")
    for name, r in models.items():
        if "profile" in r:
            lines += ["", f"profile of {name}: {r['profile'].get('summary', r['profile'])}",
                      r["profile"].get("table", "")]
    return "\n".join(lines)


def _n(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _check(r: dict, key: str) -> str:
    if "skipped" in r:
        return "skipped"
    if key == "same_completions":
        return (f"{r['same_completions']:.0%}, {r['logprob_gap_p95']:.1e} / "
                f"{r['logprob_gap_max']:.1e}")
    return f"{r['logprob_gap_p95']:.1e} / {r['logprob_gap_max']:.1e}, {r['mismatch_kl']:.1e}"

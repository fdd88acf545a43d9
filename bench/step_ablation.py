"""What each local-backend optimisation saves: the real step, and the step without it.

Runs one RL step's shapes (`--batch` prompts x `--group` completions x `--max-tokens`, the
quickstart's) on the real model and LoRA adapter and times, median of `--repeat` after one
warm-up of each, the variants of a phase run in turn (ABC ABC ...: a drifting machine slows
them alike):

- sample: `LocalBackend.sample` (each prompt prefilled once, its KV cache repeated for the group;
  finished rows leave the batch);
  - no shared prefill: the same prompts repeated `group` times, one completion each;
  - finished rows kept: EOS ignored, so every row decodes `max_tokens` (an upper bound of
    keeping finished rows in the batch; the completions then differ);
  - growing KV cache: transformers' `DynamicLayer` (a concatenation of the whole cache per
    token and layer) instead of the cache reserved for prompt + max_tokens;
  - multinomial draw: `torch.multinomial` (one random number per vocabulary entry) instead of
    one uniform per row through the cumulative distribution (the completions then differ);
  - stop string `--stop` (training.stop): rows end when their text completes it (the same
    completions, cut there; the step's time with it, not a saving the default step has);
  - compiled decoding step (`[backend] compile = true`, unless `--no-compile`): the step
    through torch.compile; its first call, compile included, is timed apart;
- train: `LocalBackend.forward_backward` (distinct prompts once per micro-batch, completions on
  their repeated cache, only loss positions through the LM head);
  - plain: every sequence in full, right-padded, LM head on every position, then the same loss;
  - one suffix bucket: the completions of a micro-batch padded to its longest, not run in
    length buckets (`training.pack.length_buckets`);
  - second forward: a no-grad pass over the same batch, what recomputing the sampler's
    log-probs (or a reference model) would add.

    python -m bench.step_ablation [--model smollm2-135m-instruct] [--dtype auto] [--repeat 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time
from pathlib import Path
from unittest import mock

from bench.timing import interleaved
from retrain.machine.cpu import auto_threads


def plain_forward_backward(backend, datums, loss, pad_id: int) -> float:
    """The unoptimised training pass: full sequences, full LM head, the same per-token loss."""
    import torch

    from retrain.backends.local.sampling.exact import token_logprobs
    from retrain.backends.local.training import policy_losses

    net = backend.model.net
    net.train()
    width = max(len(d) for d in datums)
    ids = torch.full((len(datums), width), pad_id, dtype=torch.long)
    tgt = torch.zeros((len(datums), width), dtype=torch.long)
    mask = torch.zeros((len(datums), width))
    old, adv = torch.zeros((len(datums), width)), torch.zeros((len(datums), width))
    for row, d in enumerate(datums):
        n = len(d)
        ids[row, :n] = torch.tensor(d.input_tokens)
        tgt[row, :n] = torch.tensor(d.target_tokens)
        mask[row, :n] = torch.tensor(d.mask)
        old[row, :n], adv[row, :n] = torch.tensor(d.logprobs), torch.tensor(d.advantages)
    attention = (torch.arange(width)[None, :] < torch.tensor([len(d) for d in datums])[:, None])
    logits = net(input_ids=ids, attention_mask=attention.long()).logits
    lp = token_logprobs(logits, loss.temperature).gather(-1, tgt[..., None]).squeeze(-1)
    keep = mask > 0
    per_tok = policy_losses.token_losses(lp[keep], old[keep], adv[keep], loss).loss
    total = per_tok.sum() / keep.sum()
    total.backward()
    backend._zero_grad()
    return float(total.detach())


_MULTINOMIAL: dict = {}


def multinomial_draw(logprobs, params, generator):
    """The draw before issue 29: `torch.multinomial`, one exponential per vocabulary entry."""
    import torch

    if params.temperature == 0:
        return logprobs.argmax(dim=-1)
    probs = logprobs.exp()
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p
        sorted_p = sorted_p.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    if isinstance(generator, torch.Tensor):  # the rows' uniforms: draw from a stream of its own
        generator = _MULTINOMIAL.setdefault("g", torch.Generator().manual_seed(1))
    if isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return torch.cat([torch.multinomial(probs[i:i + 1], 1, generator=g)
                      for i, g in enumerate(generator)]).squeeze(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--stop", default="\n\n", help="the stop string of the stop row")
    ap.add_argument("--no-compile", action="store_true", help="leave out the compiled row "
                    "(its compile takes minutes on a CPU)")
    args = ap.parse_args()

    import torch
    from transformers.utils import logging as hf_logging

    from retrain.backends.base import LossConfig, SamplingParams, make_datum
    from retrain.backends.local.backend import LocalBackend
    from retrain.backends.local.model import LocalModel
    from retrain.backends.local.sampling import exact
    from retrain.backends.local.sampling.compiled import CompiledDecoder
    from retrain.backends.local.sampling.exact import sample_batch
    from retrain.backends.local.training.pack import BUCKET_OVERHEAD
    from retrain.backends.models import resolve_model
    from retrain.config.sections import DataConfig
    from retrain.environments.tasks import load_task, render_prompt

    hf_logging.disable_progress_bar()
    model = LocalModel.load(resolve_model(args.model), args.dtype, "cpu", auto_threads())
    backend = LocalBackend.new_adapter(model, "bench", 8, 16.0, 0.0, ["q_proj", "v_proj"], seed=0)
    data = DataConfig(operations=["+", "*"], eval_size=0, size=64)
    splits = load_task(data, seed=7, config_dir=Path.cwd())
    prompts = [render_prompt(model.tokenizer, p, data) for p in splits.train[:args.batch]]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=1)
    n, r = args.group, args.repeat
    print(f"{platform.machine()}, {model.summary}")
    print(f"{args.batch} prompts x {n} completions x up to {args.max_tokens} tokens, "
          f"median of {r} after a warm-up, variants run in turn\n")

    def no_eos():  # sample_batch runs under inference_mode itself
        return sample_batch(model.net, prompts, n, params, eos_ids=set(), pad_id=model.pad_id,
                            generator=torch.Generator().manual_seed(1),
                            make_cache=backend._make_cache, cache_key=model.cache_key)

    def patched(target: str, value, fn):
        def run():
            with mock.patch.object(exact, target, value):
                return fn()
        return run

    def sample():
        return backend.sample(prompts, n, params)

    variants = {}
    if not args.no_compile:
        decoder = CompiledDecoder(model.net)

        def compiled():
            model.decoder = decoder
            try:
                return sample()
            finally:
                model.decoder = None

        start = time.perf_counter()
        compiled()
        first_compiled = time.perf_counter() - start
        variants["compiled"] = compiled

    flat = [p for p in prompts for _ in range(n)]
    s = interleaved({"sample": sample,
                     "flat": lambda: backend.sample(flat, 1, params),
                     "no_eos": no_eos,
                     "grown": patched("reserve", lambda cache, _capacity: cache, sample),
                     "multinomial": patched("draw", multinomial_draw, sample),
                     "stop": lambda: backend.sample(prompts, n, dataclasses.replace(
                         params, stop_strings=(args.stop,))), **variants}, r)
    t_sample, groups = s["sample"]

    def tokens(name: str) -> int:
        return sum(len(c.tokens) for g in s[name][1] for c in g)

    rows = [("sample", t_sample, f"{tokens('sample')} completion tokens")]
    for key, label, note in (
            ("flat", "  without shared prefill", ""),
            ("no_eos", "  finished rows kept (EOS ignored)", f", {tokens('no_eos')} tokens"),
            ("grown", "  growing KV cache (concatenated)", ""),
            ("multinomial", "  multinomial draw",
             f", {tokens('multinomial')} tokens (another random stream): "
             f"{s['multinomial'][0] / tokens('multinomial') / (t_sample / tokens('sample')):.2f}x "
             "per token"),
            ("stop", f"  stop string {args.stop!r}", f", {tokens('stop')} tokens")):
        rows.append((label, s[key][0], f"{s[key][0] / t_sample:.2f}x{note}"))
    if "compiled" in s:
        same = [[c.tokens for c in g] for g in s["compiled"][1]] == \
            [[c.tokens for c in g] for g in groups]
        rows.append(("  compiled decoding step", s["compiled"][0],
                     f"{s['compiled'][0] / t_sample:.2f}x, first call {first_compiled:.1f} s "
                     f"(compiling), {'the same' if same else 'other'} tokens"))

    loss = LossConfig(temperature=args.temperature)
    datums = [make_datum(p, c, adv) for p, g in zip(prompts, groups, strict=True)
              for c, adv in zip(g, [1.0, -1.0] * n, strict=False)]

    def second_forward():
        with torch.inference_mode():
            backend.model.net.eval()
            backend._forward_logprobs(backend.model.net, datums, loss.temperature)

    def one_bucket():
        backend.bucket_overhead = 10**9  # a bucket then costs more than any padding
        try:
            return backend.forward_backward(datums, loss)
        finally:
            backend.bucket_overhead = BUCKET_OVERHEAD
            backend._zero_grad()

    t = interleaved({"train": lambda: (backend.forward_backward(datums, loss),
                                       backend._zero_grad())[0],
                     "one_bucket": one_bucket,
                     "plain": lambda: plain_forward_backward(backend, datums, loss, model.pad_id),
                     "second": second_forward}, r)
    t_train, out = t["train"]
    rows.append(("train (forward+backward)", t_train,
                 f"{sum(len(d) for d in datums)} tokens, loss {out.loss:.6f}"))
    rows.append(("  one suffix bucket (padded)", t["one_bucket"][0],
                 f"{t['one_bucket'][0] / t_train:.2f}x, loss {t['one_bucket'][1].loss:.6f}"))
    rows.append(("  plain full-sequence pass", t["plain"][0],
                 f"{t['plain'][0] / t_train:.2f}x, loss {t['plain'][1]:.6f}"))
    share = t["second"][0] / (t_sample + t_train)
    rows.append(("  + a second forward (not done)", t["second"][0], f"+{share:.0%} of a step"))
    for name, secs, note in rows:
        print(f"{name:36s} {secs:8.2f} s   {note}")


if __name__ == "__main__":
    main()

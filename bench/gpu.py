"""The local backend on one GPU: the exact (eager) sampler against the fast one, and an RL step.

One command on a machine with a CUDA GPU, no network, nothing but this repository (torch,
transformers and peft; no model weights travel: the models are randomly initialised from the
SmolLM2-135M and Qwen2.5-0.5B configurations, since shapes decide speed):

    python -m bench.gpu                      # table on stdout, JSON to $OUT/gpu.json
    python -m bench.gpu --out results.json
    python -m bench.gpu --smoke              # CPU, tiny shapes, seconds: the script still runs

What it measures, per model (bfloat16):
- decode tokens/s at batch 64 and 256 (groups of 8), 128-token prompts, 256 new tokens, EOS
  ignored: today's eager sampler (`sample_batch`) and the fast one (`StaticSampler`, merged
  LoRA, CUDA graphs), same process, same card, median of 3 after a warm-up;
- the static path through the unmerged adapter against today's loop with the same counter
  draws: share of identical completions and the log-prob gap (exact numerics, other kernels);
- the fast sampler's log-probs against the trainer's forward of the same tokens: the gap and
  the mismatch KL, mean of r - log r - 1 with log r = trainer - sampler;
- one RL step (sample, forward_backward, AdamW; LoRA r = 16): its phases, peak GPU memory;
- graphs captured before an AdamW step, replayed after it (merged buffers refreshed in
  place): the same tokens and log-probs as the same steps run eagerly.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from retrain.backends.base import AdamParams, LossConfig, SamplingParams, make_datum
from retrain.backends.local.backend import LocalBackend
from retrain.backends.local.model import LocalModel
from retrain.backends.local.sampling.counter_rng import CounterDraws
from retrain.backends.local.sampling.exact import sample_batch
from retrain.backends.local.sampling.fast import StaticSampler

SHAPES = {  # the published configurations' shapes
    "smollm2-135m": dict(arch="llama", layers=30, hidden=576, heads=9, kv=3, ffn=1536,
                         vocab=49152, theta=100000.0, eps=1e-5),
    "qwen2.5-0.5b": dict(arch="qwen2", layers=24, hidden=896, heads=14, kv=2, ffn=4864,
                         vocab=151936, theta=1000000.0, eps=1e-6),
}
SMOKE_SHAPES = {"tiny": dict(arch="llama", layers=2, hidden=64, heads=4, kv=2, ffn=128,
                             vocab=512, theta=10000.0, eps=1e-5)}


@dataclass
class Plan:
    device: str = "cuda"
    dtype: str = "bfloat16"
    batches: tuple[int, ...] = (64, 256)
    group: int = 8
    prompt_len: int = 128
    new_tokens: int = 256
    repeats: int = 3
    rl_prompts: int = 32
    lora_rank: int = 16


SMOKE = Plan(device="cpu", dtype="float32", batches=(4, 8), group=2, prompt_len=8,
             new_tokens=12, repeats=1, rl_prompts=2, lora_rank=4)


def _tokenizer(vocab: int):
    """A word-level tokenizer over the model's ids (EOS = 1): decoding is never needed."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    tk = Tokenizer(models.WordLevel(vocab=words, unk_token="t2"))
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="t0", eos_token="t1",
                                   unk_token="t2")


def build(shape: dict, plan: Plan, name: str) -> LocalBackend:
    """A random model of `shape` on the device, with a LoRA adapter whose B is not zero."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kinds = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config_cls, model_cls = kinds[shape["arch"]]
    cfg = config_cls(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                     intermediate_size=shape["ffn"], num_hidden_layers=shape["layers"],
                     num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"],
                     rope_theta=shape["theta"], rms_norm_eps=shape["eps"],
                     max_position_embeddings=4096, tie_word_embeddings=True,
                     bos_token_id=1, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(plan.device):
        net = model_cls(cfg).to(getattr(torch, plan.dtype)).eval()
    model = LocalModel(net, _tokenizer(shape["vocab"]), torch.device(plan.device), name)
    backend = LocalBackend.new_adapter(model, "bench", lora_rank=plan.lora_rank,
                                       lora_alpha=2.0 * plan.lora_rank, seed=1)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for key, p in backend.params.items():
            if ".lora_B." in key:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.01).to(p.device, p.dtype))
    return backend


def _sync(plan: Plan) -> None:
    if plan.device == "cuda":
        torch.cuda.synchronize()


def _prompts(count: int, plan: Plan, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, plan.prompt_len), generator=gen).tolist()


def _net(backend: LocalBackend):
    backend.model.activate(backend.adapter)
    return backend.model.net.eval()


def _common(backend: LocalBackend) -> dict:
    m = backend.model
    return {"eos_ids": set(), "pad_id": m.pad_id, "make_cache": backend._make_cache,
            "cache_key": m.cache_key}


def eager(backend, prompts, params, plan, draws=None):
    """Today's sampler (EOS ignored), with torch.Generator draws or `draws`."""
    gen = draws or torch.Generator(backend.model.device).manual_seed(0)
    return sample_batch(_net(backend), prompts, plan.group, params, generator=gen,
                        **_common(backend))


def fast(sampler: StaticSampler, backend, prompts, params, plan, seed=0):
    return sampler.sample(_net(backend), backend.adapter, prompts, plan.group, params,
                          seeds=[seed] * len(prompts), prompt_ids=list(range(len(prompts))),
                          **_common(backend))


def _median_s(run, plan: Plan) -> float:
    run()  # warm-up: allocations, cuBLAS, graph captures
    times = []
    for _ in range(plan.repeats):
        _sync(plan)
        t0 = time.perf_counter()
        run()
        _sync(plan)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_speed(backend, plan: Plan, sampler: StaticSampler) -> list[dict]:
    params = SamplingParams(max_tokens=plan.new_tokens, temperature=1.0)
    vocab = backend.model.vocab_size
    rows = []
    for batch in plan.batches:
        prompts = _prompts(batch // plan.group, plan, vocab, seed=batch)
        tokens = batch * plan.new_tokens
        e = _median_s(lambda p=prompts: eager(backend, p, params, plan), plan)
        f = _median_s(lambda p=prompts: fast(sampler, backend, p, params, plan), plan)
        rows.append({"batch": batch, "eager_tok_s": tokens / e, "fast_tok_s": tokens / f,
                     "speedup": e / f})
    return rows


def _gaps(a, b) -> tuple[float, list[float]]:
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


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def exactness(backend, plan: Plan) -> dict:
    """The static path (unmerged adapter) against today's loop with the same draws."""
    params = SamplingParams(max_tokens=plan.new_tokens, temperature=1.0)
    prompts = _prompts(plan.batches[0] // plan.group, plan, backend.model.vocab_size, seed=7)
    ids = list(range(len(prompts)))
    ref = eager(backend, prompts, params, plan,
                CounterDraws([0] * len(prompts), ids, plan.group, backend.model.device))
    static = StaticSampler(backend.model.base, backend.model.device, merged=False)
    same, diffs = _gaps(ref, fast(static, backend, prompts, params, plan))
    return {"same_completions": same, "logprob_gap_p95": _pct(diffs, 0.95),
            "logprob_gap_max": max(diffs, default=0.0)}


def mismatch(backend, plan: Plan, sampler: StaticSampler) -> dict:
    """The fast sampler's log-probs against the trainer's forward of the same tokens."""
    params = SamplingParams(max_tokens=plan.new_tokens, temperature=1.0)
    prompts = _prompts(plan.batches[0] // plan.group, plan, backend.model.vocab_size, seed=8)
    groups = fast(sampler, backend, prompts, params, plan, seed=3)
    datums = [make_datum(p, c, 0.0) for p, g in zip(prompts, groups, strict=True) for c in g]
    trainer = backend.logprobs(datums)
    log_r, diffs = [], []
    for d, lp in zip(datums, trainer, strict=True):
        for m, s, t in zip(d.mask, d.logprobs, lp, strict=True):
            if m > 0:
                log_r.append(t - s)
                diffs.append(abs(t - s))
    kl = statistics.fmean(_mismatch_kl(x) for x in log_r)
    return {"logprob_gap_p50": _pct(diffs, 0.5), "logprob_gap_p95": _pct(diffs, 0.95),
            "logprob_gap_max": max(diffs), "mismatch_kl": kl}


def _mismatch_kl(log_r: float) -> float:
    import math

    return math.exp(log_r) - log_r - 1.0


def rl_step(backend, plan: Plan) -> dict:
    """One RL step through the backend (fast sampler): sample, forward_backward, AdamW."""
    params = SamplingParams(max_tokens=plan.new_tokens, temperature=1.0, seed=5)
    prompts = _prompts(plan.rl_prompts, plan, backend.model.vocab_size, seed=9)
    if plan.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    phases = {}
    _sync(plan)
    t0 = time.perf_counter()
    groups = backend.sample(prompts, plan.group, params)
    _sync(plan)
    phases["sample_s"] = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(6)
    datums = [make_datum(p, c, float(torch.randn(1, generator=gen)))
              for p, g in zip(prompts, groups, strict=True) for c in g]
    t0 = time.perf_counter()
    out = backend.forward_backward(datums, LossConfig())
    _sync(plan)
    phases["forward_backward_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    backend.optim_step(AdamParams(learning_rate=1e-3))
    _sync(plan)
    phases["optim_s"] = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if plan.device == "cuda" else None
    return {**phases, "completions": len(datums), "loss": out.loss, "peak_gib": peak,
            "step_s": sum(phases.values())}


def graph_after_adamw(backend, plan: Plan) -> dict:
    """Graphs captured before an AdamW step and replayed after it give the eager steps'
    tokens and log-probs (the merged buffers were refreshed in place)."""
    if plan.device != "cuda":
        return {"skipped": "no CUDA: graphs capture only there"}
    params = SamplingParams(max_tokens=48, temperature=0.0)
    prompts = _prompts(4, plan, backend.model.vocab_size, seed=10)
    graphed = StaticSampler(backend.model.base, backend.model.device, merged=True)
    before = fast(graphed, backend, prompts, params, plan)
    captures = graphed.graphs.captures
    datums = [make_datum(p, c, 1.0) for p, g in zip(prompts, before, strict=True) for c in g]
    backend.forward_backward(datums, LossConfig())
    backend.optim_step(AdamParams(learning_rate=1e-2))
    after = fast(graphed, backend, prompts, params, plan)
    plain = StaticSampler(backend.model.base, backend.model.device, merged=True, graphs=False)
    plain.window_step = graphed.window_step
    same, diffs = _gaps(after, fast(plain, backend, prompts, params, plan))
    moved, _ = _gaps(before, after)
    return {"recaptured": graphed.graphs.captures - captures, "replays": graphed.graphs.replays,
            "same_completions": same, "logprob_gap_max": max(diffs, default=0.0),
            "changed_by_the_step": 1.0 - moved}


def run_model(name: str, shape: dict, plan: Plan) -> dict:
    t0 = time.perf_counter()
    backend = build(shape, plan, name)
    sampler = StaticSampler(backend.model.base, backend.model.device, merged=True)
    out = {"decode": decode_speed(backend, plan, sampler),
           "exact": exactness(backend, plan), "fast": mismatch(backend, plan, sampler)}
    backend.model.use_sampler("fast")
    out["rl_step"] = rl_step(backend, plan)
    out["graph_after_adamw"] = graph_after_adamw(backend, plan)
    out["wall_s"] = time.perf_counter() - t0
    del backend, sampler
    if plan.device == "cuda":
        torch.cuda.empty_cache()
    return out


def table(results: dict) -> str:
    lines = ["| model | batch | eager tok/s | fast tok/s | speedup |", "|---|---|---|---|---|"]
    for name, r in results["models"].items():
        for d in r["decode"]:
            lines.append(f"| {name} | {d['batch']} | {d['eager_tok_s']:,.0f} | "
                         f"{d['fast_tok_s']:,.0f} | {d['speedup']:.1f}x |")
    lines += ["", "| model | exact: same completions, lp gap p95 / max | fast: lp gap p95 / "
              "max, mismatch KL | RL step s (sample / train / optim) | peak GiB | graph "
              "after AdamW |", "|---|---|---|---|---|---|"]
    for name, r in results["models"].items():
        e, f, s, g = r["exact"], r["fast"], r["rl_step"], r["graph_after_adamw"]
        graph = g.get("skipped") or (f"same {g['same_completions']:.0%}, gap "
                                     f"{g['logprob_gap_max']:.1e}, recaptured "
                                     f"{g['recaptured']}")
        peak = "-" if s["peak_gib"] is None else f"{s['peak_gib']:.1f}"
        lines.append(
            f"| {name} | {e['same_completions']:.0%}, {e['logprob_gap_p95']:.1e} / "
            f"{e['logprob_gap_max']:.1e} | {f['logprob_gap_p95']:.1e} / "
            f"{f['logprob_gap_max']:.1e}, {f['mismatch_kl']:.1e} | {s['step_s']:.2f} "
            f"({s['sample_s']:.2f} / {s['forward_backward_s']:.2f} / {s['optim_s']:.2f}) | "
            f"{peak} | {graph} |")
    return "\n".join(lines)


def _machine(plan: Plan) -> dict:
    import transformers

    gpu = torch.cuda.get_device_name() if plan.device == "cuda" else None
    return {"device": gpu or plan.device, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": sys.version.split()[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (seconds)")
    ap.add_argument("--out", help="JSON path (default: $OUT/gpu.json, else ./gpu.json)")
    ap.add_argument("--models", nargs="*", help="a subset of " + ", ".join(SHAPES))
    args = ap.parse_args(argv)
    plan, shapes = (SMOKE, SMOKE_SHAPES) if args.smoke else (Plan(), SHAPES)
    if args.smoke:
        torch.set_num_threads(1)  # seconds of work; leave the other cores alone
    if plan.device == "cuda" and not torch.cuda.is_available():
        print("bench.gpu: no CUDA device here; --smoke runs the same code on the CPU",
              file=sys.stderr)
        return 2
    chosen = {k: v for k, v in shapes.items() if not args.models or k in args.models}
    results = {"machine": _machine(plan), "plan": asdict(plan), "models": {}}
    for name, shape in chosen.items():
        results["models"][name] = run_model(name, shape, plan)
        print(f"{name}: done in {results['models'][name]['wall_s']:.0f}s", flush=True)
    print(table(results))
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "gpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

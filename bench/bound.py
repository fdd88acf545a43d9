"""Each phase of a real RL step as a fraction of what this machine can do (issue 29).

In one process: load the configured model and LoRA adapter (the `bench.step_time` configs),
then for `--steps` rounds (after one warm-up) alternate
- measuring the matmul throughput at the shapes each phase really runs (every linear layer of
  the model, each with its own weight so that they stream from memory as in the model, at the
  phase's rows: the prompts' prefill, the decode batch, a training micro-batch; the LM head at
  the rows that get logits), best of the rounds, and
- a real step: `LocalBackend.sample` (prompts x group, temperature 1), then
  `forward_backward` + `optim_step`, median of the rounds.
The memory bandwidth is a large copy. FLOPs and bytes of each phase come from
`retrain.control.stepcost` with the step's real prompt and completion lengths; a phase's bound
is max(FLOPs / matmul rate, bytes / bandwidth) (`retrain.control.bound`).

    python -m bench.bound --config smollm2-fp32      # also: smollm2 (bf16), tiny

It also measures the machine's canonical peaks and caches them (`retrain.machine.peaks`), the
numbers the roofline hints and `retrain explain` use.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench.step_time import CONFIGS


@dataclass
class Phase:
    """One phase of one step: its wall time and what it computed."""

    seconds: float
    rows: int            # mean rows per matmul (tokens through the body at once)
    head_rows: int       # mean rows per LM-head matmul


def linear_shapes(model) -> tuple[Counter, tuple[int, int]]:
    """(in, out) of every linear layer of the body with its count, and the LM head's."""
    import torch

    head = model.base.get_output_embeddings()
    shapes: Counter = Counter()
    for name, mod in model.base.named_modules():
        if isinstance(mod, torch.nn.Linear) and mod is not head and "lora_" not in name:
            shapes[(mod.in_features, mod.out_features)] += 1
    return shapes, (head.weight.shape[1], head.weight.shape[0])


def gemms(body: Counter, head: tuple[int, int], rows: int, head_rows: int) -> list:
    from retrain.machine.measure import Gemm

    out = [Gemm(max(rows, 1), k, n, c) for (k, n), c in body.items()]
    return out + [Gemm(max(head_rows, 1), head[0], head[1])]


def one_step(backend, prompts, spec, seed: int):
    """Sample, then train; the phases' times and shapes, and the lengths for the costs."""
    from retrain.backends.base import AdamParams, LossConfig, SamplingParams, make_datum
    from retrain.backends.local.training.pack import length_buckets
    from retrain.backends.local.training.plan import split_point

    group = spec["group"]
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=1.0, seed=seed)
    t0 = time.perf_counter()
    groups = backend.sample(prompts, group, params)
    t_sample = time.perf_counter() - t0
    lengths = [[len(c.tokens) for c in g] for g in groups]
    datums = [make_datum(p, c, adv) for p, g in zip(prompts, groups, strict=True)
              for c, adv in zip(g, [1.0, -1.0] * group, strict=False)]
    t0 = time.perf_counter()
    out = backend.forward_backward(datums, LossConfig(temperature=1.0))
    backend.optim_step(AdamParams(learning_rate=spec["lr"]))
    t_train = time.perf_counter() - t0
    units = backend._plan(datums, backend.micro_batch_size)
    prefix, padded, runs = 0, 0, 0  # the suffixes run in length buckets (training/pack.py)
    for u in units:
        splits = [split_point(datums[i]) for i in u.index]
        distinct = {tuple(datums[i].input_tokens[:s]) for i, s in zip(u.index, splits,
                                                                       strict=True)}
        prefix += sum(len(p) for p in distinct)
        suffix = [len(datums[i]) - s for i, s in zip(u.index, splits, strict=True)]
        for run in length_buckets(suffix, backend.bucket_overhead):
            padded += len(run) * max(suffix[r] for r in run)
            runs += 1
    tokens = int(out.metrics["tokens"])
    steps = max(max(c) for c in lengths)
    width = max(len(p) for p in prompts)
    sample = Phase(t_sample, rows=round(sum(map(sum, lengths)) / steps),
                   head_rows=round(sum(map(sum, lengths)) / steps))
    prefill_rows = len(prompts) * width
    train = Phase(t_train, rows=round((padded + prefix) / len(units)),
                  head_rows=round(tokens / len(units)))
    return sample, train, prefill_rows, lengths, tokens, len(units), prefix


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=list(CONFIGS), default="smollm2-fp32")
    ap.add_argument("--steps", type=int, default=2, help="measured steps (after one warm-up)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    args = ap.parse_args()

    import torch
    from transformers.utils import logging as hf_logging

    from retrain.backends.local.backend import LocalBackend
    from retrain.backends.local.model import LocalModel
    from retrain.backends.models import resolve_model
    from retrain.config.sections import DataConfig
    from retrain.control.bound import PhaseBound
    from retrain.control.stepcost import decode_cost, prefill_cost, train_cost
    from retrain.environments.tasks import load_task, render_prompt
    from retrain.machine import measure, peaks
    from retrain.machine.cpu import auto_threads, cpu_model_name

    hf_logging.disable_progress_bar()
    spec = CONFIGS[args.config]
    model = LocalModel.load(resolve_model(spec["model"]), spec["dtype"], "cpu",
                            args.threads or auto_threads())
    backend = LocalBackend.new_adapter(model, "bench", spec["lora_rank"],
                                       float(spec["lora_alpha"]), 0.0, spec["target_modules"],
                                       seed=0)
    data = DataConfig(operations=["+"], eval_size=0, size=64)
    splits = load_task(data, seed=7, config_dir=Path.cwd())
    dtype = next(model.base.parameters()).dtype
    body, head = linear_shapes(model)
    cost = model.cost_model()
    print(f"{cpu_model_name()} ({platform.machine()}, {os.cpu_count()} cores), {model.summary}")
    print(f"{args.config}: {spec['batch']} prompts x {spec['group']} completions x up to "
          f"{spec['max_tokens']} tokens, LoRA r={spec['lora_rank']}; {args.steps} steps after "
          "a warm-up, each after a matmul measurement at its shapes\n", flush=True)

    rates: dict[str, float] = {}
    results = []
    for step in range(args.steps + 1):
        b = spec["batch"]
        prompts = [render_prompt(model.tokenizer, p, data)
                   for p in splits.train[step * b:(step + 1) * b]]
        res = one_step(backend, prompts, spec, seed=step)
        sample, train, prefill_rows = res[0], res[1], res[2]
        shapes = {"prefill": gemms(body, head, prefill_rows, b),
                  "decode": gemms(body, head, sample.rows, sample.head_rows),
                  "train": gemms(body, head, train.rows, train.head_rows)}
        for name, g in shapes.items():
            rates[name] = max(rates.get(name, 0.0), measure.gemm_gflops(g, dtype, repeat=3))
        if step > 0:  # the first is the warm-up
            results.append((prompts, res))
        print(f"step {step}{' (warm-up)' if step == 0 else ''}: sample {sample.seconds:.2f} s, "
              f"train {train.seconds:.2f} s", flush=True)
    bw = measure.bandwidth_gb_s()
    machine = peaks.measure_peaks(str(dtype).removeprefix("torch."), torch.get_num_threads())

    rows = []
    for prompts, (sample, train, _, lengths, tokens, units, prefix) in results:
        plens = [len(p) for p in prompts]
        pre = PhaseBound("prefill", prefill_cost(cost, plens), rates["prefill"], bw)
        dec = PhaseBound("decode", decode_cost(cost, plens, lengths), rates["decode"], bw)
        trn = PhaseBound("train", train_cost(cost, tokens, units, prefix), rates["train"], bw)
        rows.append((sample.seconds, pre, dec, train.seconds, trn))
    med = statistics.median
    t_sample, t_train = med(r[0] for r in rows), med(r[3] for r in rows)
    pre, dec, trn = rows[len(rows) // 2][1], rows[len(rows) // 2][2], rows[len(rows) // 2][4]
    sample_bound = pre.bound_s + dec.bound_s
    print(f"\nmachine: {machine.gflops:.1f} GFLOP/s {machine.dtype} matmul "
          f"{'x'.join(map(str, measure.CANONICAL))}, {bw:.1f} GB/s copy, "
          f"{torch.get_num_threads()} threads (cached in {peaks.cache_path()})\n")
    print("| phase | measured s | GFLOP | GB moved | matmul GFLOP/s at its shapes | "
          "bound s (limit) | fraction of bound |")
    print("|---|---|---|---|---|---|---|")
    for p in (pre, dec):
        print(f"| sample: {p.name} | | {p.cost.flops / 1e9:.1f} | {p.cost.bytes_moved / 1e9:.2f} "
              f"| {p.gflops:.1f} | {p.bound_s:.2f} ({p.limit}) | |")
    print(f"| **sample** | {t_sample:.2f} | {(pre.cost.flops + dec.cost.flops) / 1e9:.1f} | "
          f"{(pre.cost.bytes_moved + dec.cost.bytes_moved) / 1e9:.2f} | | {sample_bound:.2f} | "
          f"**{sample_bound / t_sample:.0%}** |")
    print(f"| **train** | {t_train:.2f} | {trn.cost.flops / 1e9:.1f} | "
          f"{trn.cost.bytes_moved / 1e9:.2f} | {trn.gflops:.1f} | {trn.bound_s:.2f} "
          f"({trn.limit}) | **{trn.fraction(t_train):.0%}** |")


if __name__ == "__main__":
    main()

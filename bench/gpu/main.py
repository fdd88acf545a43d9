"""The local backend on one GPU: the exact sampler against the fast one, and an RL step.

One command on a machine with a CUDA GPU, no network, nothing but this repository (torch,
transformers and peft; no model weights travel: the models are randomly initialised from the
SmolLM2-135M, Qwen2.5-0.5B and Qwen3-0.6B configurations, since shapes decide speed):

    python -m bench.gpu                      # tables on stdout, JSON to $OUT/gpu.json
    python -m bench.gpu --profile            # + where a fast decoding step's time goes
    python -m bench.gpu --out results.json --models qwen3-0.6b
    python -m bench.gpu --smoke              # CPU, tiny shapes, seconds: the script still runs
    python -m bench.gpu --seconds 540        # a longer budget than the default 330 s

The whole command keeps to `--seconds` (default 330: a device machine lends 15 minutes in all,
10 a command, and a rerun must fit): the side-by-side RL step keeps a quarter of it, each model
an equal part of the rest (55% sampling, 30% training, the RL step and graph check after), and
a measurement started past its share is reported skipped; gpu.json is written after each model.

What it measures, per model (bfloat16):
- sampling (bench/gpu/sampling.py): decode tokens/s of the exact and the fast sampler on fixed
  shapes (batch 64 to 1024) and on nano-vllm's bench recipe, their numbers against today's
  loop and against the trainer, and with --profile the top kernels and the device's idle
  gaps per decoding step; each model's sampling part keeps to its time share;
- one RL step (sample, forward_backward, AdamW; LoRA r = 16): its phases, peak GPU memory;
- the trainer (bench/gpu/training.py): forward_backward's positions/s, TFLOP/s and MFU
  against the card's own matmul rate, by layout, compiled or not, LoRA and full fine-tuning;
  after the models, the RL step of retrain's trainer beside TRL's GRPOTrainer on a
  random-init SmolLM2-135M folder with its real tokenizer (`--tokenizer DIR`, docs/gpu.md);
- graphs captured before an AdamW step, replayed after it (merged buffers refreshed in
  place): the same tokens and log-probs as the same steps run eagerly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from bench.gpu import sampling as gpu_sampling
from bench.gpu import training as gpu_training
from bench.gpu.profile import profile_decode
from bench.gpu.sampling import SMOKE_SAMPLING, SamplingPlan
from bench.gpu.sampling import prompts_for as _prompts
from bench.gpu.sampling import sync as _sync
from retrain.backends.base import AdamParams, LossConfig, SamplingParams, make_datum
from retrain.backends.local.backend import LocalBackend
from retrain.backends.local.model import LocalModel

SHAPES = {  # the published configurations' shapes
    "smollm2-135m": dict(arch="llama", layers=30, hidden=576, heads=9, kv=3, ffn=1536,
                         vocab=49152, theta=100000.0, eps=1e-5),
    "qwen2.5-0.5b": dict(arch="qwen2", layers=24, hidden=896, heads=14, kv=2, ffn=4864,
                         vocab=151936, theta=1000000.0, eps=1e-6),
    "qwen3-0.6b": dict(arch="qwen3", layers=28, hidden=1024, heads=16, kv=8, head_dim=128,
                       ffn=3072, vocab=151936, theta=1000000.0, eps=1e-6),
}
SMOKE_SHAPES = {"tiny": dict(arch="llama", layers=2, hidden=64, heads=4, kv=2, ffn=128,
                             vocab=512, theta=10000.0, eps=1e-5),
                "tiny-qwen3": dict(arch="qwen3", layers=2, hidden=64, heads=4, kv=2,
                                   head_dim=32, ffn=128, vocab=512, theta=10000.0, eps=1e-6)}


@dataclass
class Plan:
    device: str = "cuda"
    dtype: str = "bfloat16"
    group: int = 8
    prompt_len: int = 128
    new_tokens: int = 256
    repeats: int = 3
    rl_prompts: int = 32
    lora_rank: int = 16


SMOKE = Plan(device="cpu", dtype="float32", group=2, prompt_len=8,
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
    import transformers as tf

    kinds = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
             "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
             "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}
    config_cls, model_cls = kinds[shape["arch"]]
    own = {"head_dim": shape["head_dim"]} if "head_dim" in shape else {}
    cfg = config_cls(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                     intermediate_size=shape["ffn"], num_hidden_layers=shape["layers"],
                     num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"],
                     rope_theta=shape["theta"], rms_norm_eps=shape["eps"],
                     max_position_embeddings=4096, tie_word_embeddings=True,
                     bos_token_id=1, eos_token_id=1, pad_token_id=0, **own)
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


def run_model(name: str, shape: dict, plan: Plan, splan: SamplingPlan, first: bool,
              profile: bool = False, tplan: gpu_training.TrainingPlan | None = None,
              matmul_tflops: float = 0.0) -> dict:
    t0 = time.perf_counter()
    backend = build(shape, plan, name)
    out = gpu_sampling.measure(backend, name, plan, splan, first,
                               profile_decode if profile else None)
    backend.model.use_sampler("fast")
    out["rl_step"] = rl_step(backend, plan)
    out["graph_after_adamw"] = gpu_sampling.graph_after_adamw(backend, plan)
    if tplan is not None:
        out["training"] = gpu_training.measure(backend, name, shape, plan, tplan,
                                               matmul_tflops, first)
    out["wall_s"] = time.perf_counter() - t0
    del backend
    if plan.device == "cuda":
        torch.cuda.empty_cache()
    return out


def table(results: dict) -> str:
    lines = [gpu_sampling.tables(results["models"]), "",
             "| model | RL step s (sample / train / optim) | peak GiB | graph after AdamW |",
             "|---|---|---|---|"]
    for name, r in results["models"].items():
        s, g = r["rl_step"], r["graph_after_adamw"]
        graph = g.get("skipped") or (f"same {g['same_completions']:.0%}, gap "
                                     f"{g['logprob_gap_max']:.1e}, recaptured "
                                     f"{g['recaptured']}")
        peak = "-" if s["peak_gib"] is None else f"{s['peak_gib']:.1f}"
        lines.append(f"| {name} | {s['step_s']:.2f} ({s['sample_s']:.2f} / "
                     f"{s['forward_backward_s']:.2f} / {s['optim_s']:.2f}) | {peak} | {graph} |")
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
    ap.add_argument("--profile", action="store_true",
                    help="torch.profiler: top kernels and device gaps per decoding step")
    ap.add_argument("--tokenizer", help="a folder with SmolLM2's tokenizer files, for the RL "
                    "step beside TRL (default: the built-in model's, where converted)")
    ap.add_argument("--seconds", type=float, help="the command's time budget (default 330, "
                    "--smoke 600); shares shrink to fit it, never grow")
    args = ap.parse_args(argv)
    deadline = Deadline(args.seconds or (600.0 if args.smoke else 330.0))
    plan, shapes = (SMOKE, SMOKE_SHAPES) if args.smoke else (Plan(), SHAPES)
    splan = SMOKE_SAMPLING if args.smoke else SamplingPlan()
    tplan = gpu_training.SMOKE_TRAINING if args.smoke else gpu_training.TrainingPlan()
    if args.smoke:
        torch.set_num_threads(1)  # seconds of work; leave the other cores alone
    if plan.device == "cuda" and not torch.cuda.is_available():
        print("bench.gpu: no CUDA device here; --smoke runs the same code on the CPU",
              file=sys.stderr)
        return 2
    chosen = {k: v for k, v in shapes.items() if not args.models or k in args.models}
    results = {"machine": _machine(plan), "budget_s": deadline.seconds,
               "plan": asdict(plan), "sampling": asdict(splan),
               "training": asdict(tplan), "models": {},
               "matmul": gpu_training.matmul_rate(plan, tplan.matmul_size)}
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "gpu.json")
    for i, (name, shape) in enumerate(chosen.items()):
        sshare, tshare = deadline.model_shares(len(chosen) - i)
        results["models"][name] = run_model(
            name, shape, plan, replace(splan, seconds=min(splan.seconds, sshare)), i == 0,
            args.profile, replace(tplan, seconds=min(tplan.seconds, tshare)),
            results["matmul"]["tflops"])
        print(f"{name}: done in {results['models'][name]['wall_s']:.0f}s", flush=True)
        _write(results, out)  # what is measured survives a deadline
    tokenizer = (gpu_training.smoke_tokenizer() if args.smoke
                 else gpu_training.tokenizer_folder(args.tokenizer))
    side_shape = next(iter(shapes.values()))
    side = replace(tplan, side_timeout_s=min(tplan.side_timeout_s, deadline.per_tool()))
    results["side_by_side"] = gpu_training.side_by_side(side_shape, plan, side, tokenizer)
    print(table(results) + "\n\n" + gpu_training.tables(results))
    _write(results, out)
    print(f"wrote {out}")
    return 0


class Deadline:
    """The command's time budget, handed out as shares (module docstring)."""

    SIDE, SAMPLING, TRAINING = 0.25, 0.55, 0.30

    def __init__(self, seconds: float):
        self.seconds, self.end = seconds, time.perf_counter() + seconds

    def model_shares(self, models_left: int) -> tuple[float, float]:
        """(sampling, training) seconds for the next model."""
        left = self.end - time.perf_counter() - self.SIDE * self.seconds
        each = max(left, 0.0) / max(models_left, 1)
        return self.SAMPLING * each, self.TRAINING * each

    def per_tool(self) -> float:
        """Each of the side-by-side's two processes: half of what is left, at least 30 s."""
        return max(30.0, (self.end - time.perf_counter()) / 2)


def _write(results: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(main())

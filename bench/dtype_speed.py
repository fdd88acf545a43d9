"""float32 vs bfloat16 on this CPU: forward and forward+backward time of a model with LoRA.

Why `model.dtype = "auto"` picks float32 on CPUs without native bfloat16: torch emulates it
there and it is several times slower. Prints the CPU's bf16 flags and, per dtype, the median
over `--repeat` timed passes (after one warm-up pass) of a batch of random token ids.

    python -m bench.dtype_speed [--model smollm2-135m-instruct] [--batch 4] [--seq 64] [--repeat 1]
"""

from __future__ import annotations

import argparse
import platform

from bench.timing import timed
from retrain.machine.cpu import NATIVE_BF16_FLAGS, auto_threads, cpu_flags, cpu_has_native_bf16


def measure(path: str, dtype_name: str, batch: int, seq: int, repeat: int) -> tuple[float, float]:
    """(forward s, forward+backward s) for one dtype, LoRA r=8 on q_proj/v_proj."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype_name))
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16,
                                             target_modules=["q_proj", "v_proj"]))
    vocab = min(1000, model.config.vocab_size)  # tiny test models have small vocabularies
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))

    def forward() -> None:
        with torch.inference_mode():
            model(ids)

    def forward_backward() -> None:
        model.zero_grad(set_to_none=True)
        model(ids).logits.float().logsumexp(-1).mean().backward()

    return timed(forward, repeat)[0], timed(forward_backward, repeat)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()

    import torch
    from transformers.utils import logging as hf_logging

    from retrain.backends.models import resolve_model

    hf_logging.disable_progress_bar()
    torch.set_num_threads(auto_threads())
    path = resolve_model(args.model)
    flags = sorted(NATIVE_BF16_FLAGS & cpu_flags())
    print(f"{platform.machine()}, {torch.get_num_threads()} threads, native bf16: "
          f"{cpu_has_native_bf16()} (flags: {', '.join(flags) or 'none'}), "
          f"torch {torch.__version__}")
    print(f"{args.model}, {args.batch} x {args.seq} tokens, median of {args.repeat}")
    got = {}
    for name in ("float32", "bfloat16"):
        got[name] = measure(path, name, args.batch, args.seq, args.repeat)
        print(f"{name:9s} forward {got[name][0]:7.2f} s   forward+backward {got[name][1]:7.2f} s",
              flush=True)
    (f32, f32b), (b16, b16b) = got["float32"], got["bfloat16"]
    print(f"bfloat16 / float32: forward {b16 / f32:.2f}x, forward+backward {b16b / f32b:.2f}x")


if __name__ == "__main__":
    main()

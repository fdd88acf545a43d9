"""How long one `forward_backward` takes on a config's shape, on this machine's device.

The trainer's own time, without sampling, rewards or the optimizer: a lighter yardstick than
`bench.step_time` for a change to the training pass. The completions are fixed random tokens
(seeded, lengths spread over the budget, some ending at EOS), so two checkouts time the same
work; their old log-probs are the trainer's own, so the ratios are 1 as on-policy.

    .venv/bin/python -m bench.train_time       # the quickstart: SmolLM2, 4 x 8 x 48
    .venv/bin/python -m bench.train_time --model tiny-random --repeats 3

Prints one JSON line: the median seconds over `--repeats` calls after one warm-up call, the
micro-batches of the last call, and the trained tokens.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from bench.timing import timed
from retrain.backends.base import Completion, LossConfig, make_datum


def datums_for(backend, batch: int, group: int, max_tokens: int, seed: int) -> list:
    """`batch` chat prompts x `group` random completions of 1..max_tokens tokens."""
    tok = backend.tokenizer
    gen = torch.Generator().manual_seed(seed)
    eos = min(backend.model.eos_ids)
    vocab = backend.model.vocab_size
    out = []
    for i in range(batch):
        text = f"What is {i + 2} + {3 * i + 1}? End with \\boxed{{result}}."
        prompt = tok.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=True)["input_ids"]
        for j in range(group):
            n = int(torch.randint(max_tokens // 4, max_tokens + 1, (1,), generator=gen))
            tokens = torch.randint(3, vocab, (n,), generator=gen).tolist()
            if j % 3 == 0:
                tokens[-1] = eos
            out.append(make_datum(prompt, Completion(tokens, [0.0] * n, "length"),
                                  (-1.0) ** j * (1 + 0.1 * i)))
    old = backend.logprobs(out)
    for d, lp in zip(out, old, strict=True):
        d.logprobs = lp
    return out


def main(argv: list[str] | None = None) -> int:
    from retrain.backends.local.backend import LocalBackend
    from retrain.backends.local.model import LocalModel
    from retrain.backends.models import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layout", choices=("prefix", "packed"),
                    help="the training layout (default: the device's, training/forward.py)")
    args = ap.parse_args(argv)
    model = LocalModel.load(resolve_model(args.model), args.dtype, args.device, args.threads)
    backend = LocalBackend.new_adapter(model, "bench", lora_rank=8, lora_alpha=16.0, seed=0)
    datums = datums_for(backend, args.batch, args.group, args.max_tokens, seed=1)
    if args.layout:
        backend.layout = args.layout

    def once():
        out = backend.forward_backward(datums, LossConfig(temperature=0.7))
        backend._zero_grad()
        return out

    seconds, out = timed(once, args.repeats)
    print(json.dumps({"model": args.model, "summary": model.summary,
                      "layout": getattr(backend, "layout", "prefix"),
                      "forward_backward_s": round(seconds, 4),
                      "micro_batches": out.metrics.get("grad_micro_batches"),
                      "trained_tokens": out.metrics["tokens"], "repeats": args.repeats}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

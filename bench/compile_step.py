"""One decoding step, eager against compiled (`[backend] compile`), timed step by step.

Prefills the step_ablation's kind of batch (4 prompts x `--group` rows) twice, then feeds
both caches the same tokens for `--steps` steps, calling the eager and the compiled forward
in turn (the order alternating), so a machine whose load drifts slows both alike. Half-way
half the rows leave the batch, as finished rows do. Prints every step, then the compile
time (the first calls), the median step of each after `--warm` steps, the median ratio and
the largest log-prob difference.

    python -m bench.compile_step [--model smollm2-135m-instruct] [--threads 1] [--steps 32]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warm", type=int, default=4)
    args = ap.parse_args()

    import torch

    from retrain.backends.local.backend import LocalBackend
    from retrain.backends.local.model import LocalModel
    from retrain.backends.local.sampling.compiled import CompiledDecoder
    from retrain.backends.local.sampling.exact import left_pad
    from retrain.backends.local.sampling.reserved_cache import reserve
    from retrain.backends.models import resolve_model

    model = LocalModel.load(resolve_model(args.model), "float32", "cpu", args.threads)
    backend = LocalBackend.new_adapter(model, "bench", 8, 16.0, 0.0, ["q_proj", "v_proj"], seed=0)
    net, key = model.net, model.cache_key
    net.eval()
    compiled = CompiledDecoder(net)
    prompts = [[1, 5, 9, 13, 17, 21] * 12, [1, 7] * 30, [1, 3] * 36, [1, 3, 4] * 24]

    def prefill():
        ids, mask, pos = left_pad(prompts, model.pad_id, model.device)
        cache = reserve(backend._make_cache(), ids.shape[1] + args.steps + 1)
        out = net(input_ids=ids, attention_mask=mask, position_ids=pos, **{key: cache},
                  use_cache=True, logits_to_keep=1)
        cache.batch_repeat_interleave(args.group)
        return (cache, mask.repeat_interleave(args.group, dim=0),
                out.logits[:, -1].repeat_interleave(args.group, dim=0))

    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    diffs = []
    with torch.inference_mode():
        (eager_cache, mask, logits), (compiled_cache, _, _) = prefill(), prefill()
        for step in range(args.steps):
            tok = logits.argmax(-1)
            if step == args.steps // 2:  # half the rows finish
                keep = torch.arange(0, tok.shape[0], 2)
                eager_cache.batch_select_indices(keep)
                compiled_cache.batch_select_indices(keep)
                tok, mask = tok[keep], mask[keep]
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            kw = {"input_ids": tok[:, None], "attention_mask": mask, "use_cache": True,
                  "position_ids": mask.sum(dim=1, keepdim=True) - 1, "logits_to_keep": 1}
            calls = [("eager", net, eager_cache), ("compiled", compiled, compiled_cache)]
            out = {}
            for name, fn, cache in (calls if step % 2 else calls[::-1]):
                start = time.perf_counter()
                out[name] = fn(**kw, **{key: cache}).logits[:, -1].float()
                times[name].append(time.perf_counter() - start)
            logits = out["eager"]
            diffs.append(float((torch.log_softmax(out["eager"], -1)
                                - torch.log_softmax(out["compiled"], -1)).abs().max()))
            ms = {name: f"{t[-1] * 1e3:.1f} ms" for name, t in times.items()}
            print(f"step {step:3d}  rows {tok.shape[0]:3d}  eager {ms['eager']:>10}  compiled "
                  f"{ms['compiled']:>12}  log-prob diff {diffs[-1]:.1e}", flush=True)
    if compiled.failed:
        print(f"the compile failed ({compiled.failed}): the compiled column is eager")
    warm = slice(args.warm, None)
    eager, comp = times["eager"][warm], times["compiled"][warm]
    ratio = statistics.median(c / e for e, c in zip(eager, comp, strict=True))
    print(f"\n{model.summary}\nfirst {args.warm} compiled calls (compiling): "
          f"{sum(times['compiled'][:args.warm]):.1f} s; median step after them: eager "
          f"{statistics.median(eager) * 1e3:.1f} ms, compiled {statistics.median(comp) * 1e3:.1f}"
          f" ms, median ratio compiled/eager {ratio:.3f}; largest log-prob diff {max(diffs):.1e}")


if __name__ == "__main__":
    main()

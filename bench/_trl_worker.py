"""One TRL GRPOTrainer measurement, run in its own process by bench/step_time.py.

Reads a JSON spec on argv[1], trains warmup + steps RL steps, prints one JSON line with
per-step timings and the peak RSS of this process.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench._common import bench_problems, reward_texts
    from retrain.backends.models import resolve_model

    torch.set_num_threads(spec["threads"])
    dtype = getattr(torch, spec["dtype"])
    path = resolve_model(spec["model"])
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    problems = bench_problems(spec)
    rows = [{"prompt": [{"role": "user", "content": p.text}], "answer": p.answer}
            for p in problems]
    total = spec["warmup"] + spec["steps"]

    def reward(completions, answer, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return reward_texts(texts, answer, spec.get("reward", "dense"))

    args = GRPOConfig(
        output_dir=spec["out_dir"], per_device_train_batch_size=spec["batch"] * spec["group"],
        num_generations=spec["group"], gradient_accumulation_steps=1, steps_per_generation=1,
        max_completion_length=spec["max_tokens"], max_steps=total, beta=0.0,
        learning_rate=spec["lr"], temperature=1.0, logging_steps=1, report_to=[],
        save_strategy="no", bf16=spec["dtype"] == "bfloat16",
        use_cpu=spec.get("device", "cpu") == "cpu",
        gradient_checkpointing=spec.get("trl_gradient_checkpointing", True),
        seed=spec["seed"], dataloader_num_workers=0, disable_tqdm=True,
    )
    lora = LoraConfig(r=spec["lora_rank"], lora_alpha=spec["lora_alpha"],
                      target_modules=spec["target_modules"], task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tok,
                          peft_config=lora)
    timing = {"gen": [], "step": [], "completion_tokens": [], "total_tokens": []}
    original = trainer._generate_and_score_completions

    def timed_generate(inputs):
        t0 = time.perf_counter()
        out = original(inputs)
        timing["gen"].append(time.perf_counter() - t0)
        comp = int(out["completion_mask"].sum())
        timing["completion_tokens"].append(comp)
        timing["total_tokens"].append(comp + int(out["prompt_mask"].sum()))
        return out

    trainer._generate_and_score_completions = timed_generate

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            timing["step"].append(time.perf_counter() - self.t0)

    trainer.add_callback(StepTimer())
    trainer.train()
    skip = spec["warmup"]
    steps = [
        {"step_time_s": s, "sample_time_s": g, "train_time_s": s - g,
         "completion_tokens": c, "total_tokens": t}
        for s, g, c, t in zip(timing["step"], timing["gen"], timing["completion_tokens"],
                              timing["total_tokens"], strict=False)
    ][skip:]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tool": "trl", "steps": steps, "peak_rss_mb": peak}))


if __name__ == "__main__":
    main()

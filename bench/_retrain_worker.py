"""One retrain measurement, run in its own process by bench/step_time.py.

Reads a JSON spec on argv[1], runs warmup + steps RL steps through the real trainer
(`retrain.run.single.run_single`), prints one JSON line with per-step timings and peak RSS.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from bench._common import REWARD_FUNCTION, TEXT_REWARD_FUNCTION
    from retrain.config.loader import dumps_config
    from retrain.config.sections import Config
    from retrain.run.single import run_single
    from retrain.runfiles.runlog import read_metrics

    cfg = Config()
    cfg.model.name = spec["model"]
    cfg.model.dtype = spec["dtype"]
    cfg.model.threads = spec["threads"]
    cfg.model.device = spec.get("device", "auto")
    cfg.model.lora_rank = spec["lora_rank"]
    cfg.model.lora_alpha = float(spec["lora_alpha"])
    cfg.model.lora_target_modules = list(spec["target_modules"])
    cfg.data.digits = spec.get("digits", 1)
    cfg.data.operations = spec.get("operations", ["+"])
    cfg.data.eval_size = 0
    cfg.data.size = spec["batch"] * (spec["warmup"] + spec["steps"]) * 4
    cfg.reward.type = "custom"
    cfg.reward.function = (TEXT_REWARD_FUNCTION if spec.get("reward") == "text"
                           else REWARD_FUNCTION)
    t = cfg.training
    t.seed, t.batch_size, t.group_size = spec["seed"], spec["batch"], spec["group"]
    t.max_tokens, t.max_steps, t.lr = spec["max_tokens"], spec["warmup"] + spec["steps"], spec["lr"]
    t.save_every = 0
    cfg.logging.log_dir = spec["out_dir"]
    cfg.logging.run_name = "bench"
    config_path = Path(spec["out_dir"]) / "bench.toml"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(dumps_config(cfg))
    code = run_single(cfg, config_path, new=True)
    if code != 0:
        sys.exit(code)
    rows = read_metrics(Path(spec["out_dir"]) / "bench" / "metrics.jsonl").rows
    steps = [
        {"step_time_s": r["step_time_s"], "sample_time_s": r["sample_time_s"],
         "train_time_s": r["train_time_s"],
         "completion_tokens": round(r["mean_completion_tokens"] * r["num_completions"]),
         "total_tokens": round(r["tokens_per_second"] * r["step_time_s"]),
         "cpu_threads": r.get("cpu_threads")}  # after the step: fitted threads (threads = 0)
        for r in rows if "step_time_s" in r
    ][spec["warmup"]:]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"tool": "retrain", "steps": steps, "peak_rss_mb": peak}))


if __name__ == "__main__":
    main()

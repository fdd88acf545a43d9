"""Write a finished campaign of long runs for timing `retrain status` and `retrain compare`:
2 conditions x 2 seeds, N steps each, rows with a trainer's keys, a rising reward (a learning
curve, so the median final reward is reached late) and an eval every 50 steps.

    python bench/campaign/long_run.py /tmp/long 40000
    time retrain status /tmp/long; time retrain compare /tmp/long/camp
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROW = {"batch_size": 2, "group_size": 4, "num_completions": 8, "reward_std": 0.055,
       "correct_rate": 0.0, "max_token_hit_rate": 1.0, "mean_completion_tokens": 8.0,
       "loss": -1.3e-07, "grad_norm": 1.66, "lr": 0.01, "step_time_s": 0.1,
       "sample_time_s": 0.047, "reward_time_s": 0.004, "train_time_s": 0.048,
       "tokens_per_second": 10266.8, "reward_uniform_group_rate": 0.5,
       "sampler_trainer_logprob_diff": 9.3e-07, "process_max_rss_mb": 710.66, "api_wait_s": 0.0,
       "reward_failures": 0, "oom_retries": 0, "phase": "rl", "skipped_nonfinite": False,
       "sampler_trainer_logprob_diff_p95": 3.3e-06, "sampler_trainer_mismatch_kl": 8.7e-13,
       "updates": 1, "clip_fraction": 0.0, "ratio_mean": 1.0000005, "ratio_max": 1.0000043,
       "grad_noise_scale": None, "grad_coherence": None, "grad_diagnostics_s": 4.8e-06,
       "trained_completions": 4, "sample_staleness": 0, "load_average": 1.5}


def main(root: Path, steps: int) -> None:
    camp, runs = root / "camp", []
    for cond in ("a", "b"):
        for seed in (1, 2):
            name = f"{cond}_s{seed}"
            run = camp / name
            run.mkdir(parents=True, exist_ok=True)
            rnd = random.Random(name)
            with open(run / "metrics.jsonl", "w") as fh:
                for step in range(1, steps + 1):
                    row = {"step": step, **ROW, "mean_reward": step / steps + 0.05 * rnd.random(),
                           "time": 1.7e9 + step / 10}
                    if step % 50 == 0:
                        row |= {"eval_accuracy": rnd.random(), "eval_time_s": 0.1}
                    fh.write(json.dumps(row) + "\n")
            (run / "state.json").write_text(json.dumps(
                {"status": "completed", "step": steps, "max_steps": steps}))
            runs.append({"name": name, "condition": cond, "seed": seed, "status": "completed",
                         "log_dir": name, "max_steps": steps, "last_step": steps})
    (camp / "manifest.json").write_text(json.dumps(
        {"campaign": "camp", "status": "completed", "conditions": ["a", "b"], "seeds": [1, 2],
         "runs": runs}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))

"""The README.md model card `retrain export` writes: what was trained, how, for how long,
the final metrics and every `retrain eval` score the run folder holds."""

from __future__ import annotations

import json
from pathlib import Path

from retrain.results.run_rows import number, read_rows
from retrain.runfiles import runlog

CARD_METRICS = ("mean_reward", "correct_rate", "eval_accuracy", "initial_eval_accuracy",
                "sft_loss")


def eval_scores(run_dir: Path, step: int) -> list[tuple[str, int, int]]:
    """(eval file name, correct, completions) of each RUN_DIR/evals/*.jsonl of `step`."""
    out = []
    folder = Path(run_dir) / "evals"
    for path in sorted(folder.glob(f"*-step{step}*.jsonl")) if folder.is_dir() else []:
        rest = path.stem.rsplit(f"-step{step}", 1)[1]
        if rest and not rest.startswith("-"):
            continue  # step-12 files are not step 1's
        rows = runlog.read_metrics(path).rows  # one JSON object a line, torn lines skipped
        out.append((path.stem, sum(1 for r in rows if r.get("correct") is True), len(rows)))
    return out


def final_metrics(run_dir: Path, step: int) -> dict[str, tuple[int, float]]:
    """The last value of each card metric logged up to `step`, with its step."""
    found: dict[str, tuple[int, float]] = {}
    for row in read_rows(run_dir):
        if row["step"] > step:
            break
        for key in CARD_METRICS:
            if (x := number(row.get(key))) is not None:
                found[key] = (row["step"], x)
    return found


def card(run_dir: Path, *, step: int, base: str, merged: bool, max_steps: int,
         full: bool = False) -> str:
    """The model card's Markdown. `max_steps`: the configured RL steps; the run's own count
    (with its [sft] steps) where state.json holds it. `full`: a full fine-tuning run's whole
    model, which loads like a merged one."""
    state = runlog.load_state(run_dir)
    max_steps = state.max_steps if state is not None and state.max_steps else max_steps
    config = (Path(run_dir) / runlog.CONFIG_FILE).read_text(encoding="utf-8")
    kind = "every weight fine-tuned (full fine-tuning, in the run's dtype)" if full else \
        "a LoRA adapter merged into the base weights (float32)" if merged else \
        "a LoRA adapter (peft) over the base model"
    merged = merged or full  # both load in plain transformers
    load = ("from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "model = AutoModelForCausalLM.from_pretrained(PATH)\n"
            "tokenizer = AutoTokenizer.from_pretrained(PATH)") if merged else (
        "from peft import AutoPeftModelForCausalLM\n"
        "from transformers import AutoTokenizer\n"
        "model = AutoPeftModelForCausalLM.from_pretrained(PATH)\n"
        "tokenizer = AutoTokenizer.from_pretrained(PATH)")
    lines = ["---", f"base_model: {json.dumps(base)}",
             f"library_name: {'transformers' if merged else 'peft'}",
             f"tags: [retrain, reinforcement-learning, {'full-finetune' if full else 'lora'}]",
             "---", "",
             f"# {Path(run_dir).name} (step {step})", "",
             f"Trained with retrain (RL fine-tuning) from `{base}`: {kind}, the checkpoint of "
             f"step {step} of {max_steps}.", "", "## Load it", "", "```python", load, "```",
             "", f"## Metrics up to step {step}", ""]
    metrics = final_metrics(run_dir, step)
    lines += [f"- `{k}`: {v:.4g} (step {s})" for k, (s, v) in metrics.items()] or \
        ["- (no metrics logged)"]
    lines += ["", "## Evaluations (`retrain eval`)", ""]
    scores = eval_scores(run_dir, step)
    lines += [f"- `{name}`: {k}/{n} correct ({k / n:.3f})" if n else f"- `{name}`: empty"
              for name, k, n in scores] or ["- (none yet: `retrain eval RUN_DIR`)"]
    lines += ["", "## Training config", "", "```toml", config.rstrip(), "```", ""]
    return "\n".join(lines)

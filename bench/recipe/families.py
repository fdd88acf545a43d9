"""The task families the default recipe is measured on, none of them the quickstart's own
one-digit + and *, each as `--set` overrides of templates/quickstart.toml (its recipe:
GRPO, lr 1e-3, temperature 0.7, rank-8 LoRA, 4 prompts x 8 completions, 20 steps).

Every family's held-out split is scored by mean@4 (four samples per problem at the training
temperature: an unbiased pass@1 with a quarter of the greedy eval's variance at most)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EVAL = {"training.eval_samples": 4}

FAMILIES: dict[str, dict[str, object]] = {
    # two-digit additions: 2-digit operands, carries included (8100 problems)
    "add2": {"data.digits": 2, "data.operations": ["+"]},
    # one-digit subtractions, negative results included (100 problems)
    "sub1": {"data.digits": 1, "data.operations": ["-"]},
    # two-digit subtractions: borrowing, negative results included
    "sub2": {"data.digits": 2, "data.operations": ["-"]},
    # reasoning-gym's basic_arithmetic, two one-digit terms, answer tags, 2 worked examples
    "rg": {"CONFIG": "configs/env-reasoning-gym.toml", "training.max_steps": 20,
           "training.eval_every": 20},
}


def family_run(family: str) -> tuple[Path, dict[str, object]]:
    """The family's config file and its overrides: the family's own, the mean@4 eval, and one
    torch thread a run (runs go two at a time on the bench's two cores)."""
    spec = dict(FAMILIES[family])
    config = ROOT / str(spec.pop("CONFIG", "templates/quickstart.toml"))
    return config, {**spec, **EVAL, "model.threads": 1}

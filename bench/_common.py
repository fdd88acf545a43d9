"""What both sides of bench/step_time.py share: the same prompts and the same reward."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class BenchProblem:
    text: str     # the user message, exactly as retrain renders it
    answer: str


def _data_config(spec: dict):
    from retrain.config import DataConfig

    return DataConfig(source="arithmetic", digits=spec.get("digits", 1),
                      operations=spec.get("operations", ["+"]), eval_size=0,
                      size=spec["batch"] * (spec["warmup"] + spec["steps"]) * 4)


def bench_problems(spec: dict) -> list[BenchProblem]:
    """The arithmetic prompts both tools train on, in the same order."""
    from retrain.tasks import load_task, prompt_text

    data = _data_config(spec)
    splits = load_task(data, spec["seed"], Path("."))
    return [BenchProblem(prompt_text(p, data), p.answer) for p in splits.train]


def reward_texts(texts: list[str], answers: list[str]) -> list[float]:
    """retrain's `match` reward, used by the TRL side too."""
    from retrain.config import RewardConfig
    from retrain.rewards import build_scorer
    from retrain.tasks import Problem

    scorer = build_scorer(RewardConfig(type="match"), Path("."))
    return scorer.score(texts, [Problem(prompt="", answer=a, meta={}) for a in answers]).rewards

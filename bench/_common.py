"""What both sides of bench/step_time.py share: the same prompts and the same reward."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REWARD_FUNCTION = str(Path(__file__).resolve()) + ":dense_reward"
TEXT_REWARD_FUNCTION = str(Path(__file__).resolve()) + ":text_reward"


@dataclass
class BenchProblem:
    text: str     # the user message, exactly as retrain renders it
    answer: str


def _data_config(spec: dict):
    from retrain.config.sections import DataConfig

    return DataConfig(source="arithmetic", digits=spec.get("digits", 1),
                      operations=spec.get("operations", ["+"]), eval_size=0,
                      size=spec["batch"] * (spec["warmup"] + spec["steps"]) * 4)


def bench_problems(spec: dict) -> list[BenchProblem]:
    """The arithmetic prompts both tools train on, in the same order."""
    from retrain.environments.tasks import load_task, prompt_text

    data = _data_config(spec)
    splits = load_task(data, spec["seed"], Path("."))
    return [BenchProblem(prompt_text(p, data), p.answer) for p in splits.train]


def dense_reward(completion: str, answer: str) -> float:
    """`match` plus a small share of digit characters, so groups are (almost) never uniform.

    Both tools then train on every completion: retrain skips groups whose rewards are all
    equal (they carry no gradient), which would otherwise make it do less work than TRL.
    """
    from retrain.environments.answers import match_reward

    digits = sum(ch.isdigit() for ch in completion) / max(1, len(completion))
    return match_reward(completion, answer) + 0.1 * digits


def text_reward(completion: str, answer: str) -> float:
    """A reward with signal on any text, a random-init model's too (bench/gpu/training.py):
    the share of vowels among its letters, so a group's completions (almost) never tie and
    both tools train every completion. `answer` is not read."""
    letters = [ch for ch in completion.lower() if ch.isalpha()]
    return sum(ch in "aeiou" for ch in letters) / max(1, len(letters))


def reward_texts(texts: list[str], answers: list[str], reward: str = "dense") -> list[float]:
    """The benchmark reward for the TRL side (retrain loads the same function by name)."""
    fn = text_reward if reward == "text" else dense_reward
    return [fn(t, a) for t, a in zip(texts, answers, strict=True)]

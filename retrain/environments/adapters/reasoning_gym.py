"""`kind = "reasoning_gym"`: the procedural tasks of reasoning-gym, one question per episode.

    [environment]
    kind = "reasoning_gym"
    task = "basic_arithmetic"                 # or tasks = {basic_arithmetic = 2, chain_sum = 1}
    params = {min_terms = 2, max_terms = 2}   # the task's config (with tasks: one table per task)
    size = 5000                               # items; episode seed -> item seed % size
    binary = false                            # true: reward 1 only for a fully right answer
    format_reward = 0.0                       # shaping: added when the reply has answer tags
    examples = 0                              # solved items shown first (a few-shot prompt)

Items are generated lazily by index (some tasks take seconds per item). The held-out split
uses another dataset seed, so its items differ from training's. The model answers inside
<answer></answer>; the reward is the task's `score_answer` on that answer, stripped (no tag:
0). Scores are in [0, 1] with partial credit unless `binary = true`. `format_reward` is added
to a reply that answers inside the tags at all, right or wrong: shaping for a small model that
never writes them (the `formatted` metric counts such replies; `correct`, and so the held-out
success rate, stays the task's own full score). `examples` shows that many solved items of
the task (their own seed stream, the same for every episode and split) as earlier
user/assistant turns, each answered as <answer>ANSWER</answer>.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from retrain.config.sections import EnvironmentConfig
from retrain.environments.kinds import KindContext, MissingExtra
from retrain.environments.protocol import Environment, Message, Step
from retrain.errors import UserError

SYSTEM_PROMPT = ("Answer the question. Give only your final answer between <answer> and "
                 "</answer> tags, e.g. <answer>42</answer>.")
EVAL_SEED_OFFSET = 1_000_003  # the held-out split's dataset seed is the run's seed + this
EXAMPLES_SEED_OFFSET = 2_000_003  # the few-shot examples' dataset seed is the run's seed + this


class ReasoningGymTask(Environment):
    """One episode: one item of a reasoning-gym dataset, answered once."""

    def __init__(self, dataset: Any, binary: bool, format_reward: float = 0.0,
                 examples: list[Message] | None = None):
        self.dataset, self.binary, self.format_reward = dataset, binary, format_reward
        self.examples = list(examples or [])
        self.entry: dict = {}

    def reset(self, seed: int) -> list[Message]:
        self.entry = self.dataset[seed % len(self.dataset)]
        return [{"role": "system", "content": SYSTEM_PROMPT}, *self.examples,
                {"role": "user", "content": self.entry["question"]}]

    def step(self, reply: str) -> Step:
        from reasoning_gym.utils import extract_answer

        answer = extract_answer(reply, tag_name="answer", strip=True)
        metrics = {}
        try:
            score = float(self.dataset.score_answer(answer, self.entry)) if answer else 0.0
        except Exception:  # a task's scorer choking on the model's text is the model's miss
            score, metrics["score_errors"] = 0.0, 1.0
        score = min(max(score, 0.0), 1.0)
        correct = score >= 1.0
        formatted = bool(answer)
        metrics.update(score=score, correct=float(correct), formatted=float(formatted))
        reward = float(correct) if self.binary else score
        return Step(reward=reward + (self.format_reward if formatted else 0.0), done=True,
                    metrics=metrics)


def build(cfg: EnvironmentConfig, ctx: KindContext) -> Callable[[], Environment]:
    """Episodes over `cfg.task` (or the weighted mix `cfg.tasks`) with `cfg.params`."""
    dataset = make_dataset(cfg, ctx.seed + (EVAL_SEED_OFFSET if ctx.split == "eval" else 0))
    binary, format_reward = cfg.binary, cfg.format_reward
    shots = solved_examples(cfg, ctx.seed + EXAMPLES_SEED_OFFSET)
    return lambda: ReasoningGymTask(dataset, binary, format_reward, shots)


def solved_examples(cfg: EnvironmentConfig, seed: int) -> list[Message]:
    """`cfg.examples` items of the task as user/assistant turns, answered in the tags."""
    if not cfg.examples:
        return []
    items = make_dataset(replace(cfg, size=cfg.examples), seed)
    turns: list[Message] = []
    for entry in (items[i] for i in range(cfg.examples)):
        if entry["answer"] is None:
            raise UserError("environment.examples: this task has no reference answers to "
                            "show (it checks the model's proposal); set examples = 0")
        turns += [{"role": "user", "content": entry["question"]},
                  {"role": "assistant", "content": f"<answer>{entry['answer']}</answer>"}]
    return turns


def make_dataset(cfg: EnvironmentConfig, seed: int) -> Any:
    """The reasoning-gym dataset the section names; UserError on a bad name or config."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise MissingExtra("reasoning-gym") from None
    if bool(cfg.task) == bool(cfg.tasks):
        raise UserError("environment: reasoning_gym needs task = 'NAME' or a weighted "
                        "tasks = {NAME = WEIGHT, ...}, not " + ("both" if cfg.task else "neither"))
    names = [cfg.task] if cfg.task else list(cfg.tasks)
    key = "environment.task" if cfg.task else "environment.tasks"
    for name in names:
        _check_name(name, DATASETS, key)
    if cfg.task:
        return _create(reasoning_gym, cfg.task, dict(cfg.params), "environment.params",
                       size=cfg.size, seed=seed)
    return _create_mix(reasoning_gym, cfg, seed)


def _create_mix(reasoning_gym: Any, cfg: EnvironmentConfig, seed: int) -> Any:
    from reasoning_gym.composite import DatasetSpec

    unknown = sorted(set(cfg.params) - set(cfg.tasks))
    if unknown:
        raise UserError(f"environment.params: with tasks, params holds one table per task; "
                        f"{', '.join(unknown)} is not in tasks")
    specs = []
    for name, weight in cfg.tasks.items():
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0 \
                or not math.isfinite(weight):
            raise UserError(f"environment.tasks.{name} = {weight!r}: a weight must be a "
                            "positive number")
        config = cfg.params.get(name, {})
        if not isinstance(config, dict):
            raise UserError(f"environment.params.{name} must be a table of {name}'s config")
        _create(reasoning_gym, name, dict(config), f"environment.params.{name}", size=1,
                seed=0)  # checks the task's config with a message naming its key
        specs.append(DatasetSpec(name=name, weight=float(weight), config=dict(config)))
    if not math.isfinite(sum(s.weight for s in specs)):  # every item would fail
        raise UserError("environment.tasks: the weights sum past the largest float; only "
                        "their ratios matter, so use smaller numbers")
    return _create(reasoning_gym, "composite", {}, "environment.tasks", size=cfg.size,
                   seed=seed, datasets=specs)


def _create(reasoning_gym: Any, name: str, config: dict, key: str, **fixed: Any) -> Any:
    for reserved in ("size", "seed"):
        if reserved in config:
            raise UserError(f"{key}.{reserved}: set environment.{reserved} instead"
                            if reserved == "size" else
                            f"{key}.seed: the dataset seed comes from training.seed")
    try:
        return reasoning_gym.create_dataset(name, **config, **fixed)
    except TypeError as exc:
        raise UserError(f"{key}: {name} does not take these settings ({exc}); it takes "
                        + ", ".join(_config_fields(name))) from None
    except (AssertionError, ValueError) as exc:
        raise UserError(f"{key}: {name} rejects this config: {exc or 'invalid values'}") \
            from None


def _config_fields(name: str) -> list[str]:
    from dataclasses import fields

    from reasoning_gym.factory import DATASETS

    return [f.name for f in fields(DATASETS[name][1]) if f.name not in ("size", "seed")]


def _check_name(name: str, registry: dict, key: str) -> None:
    if name in registry and name != "composite":
        return
    close = difflib.get_close_matches(name, [n for n in registry if n != "composite"], n=3)
    hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else \
        f"there are {len(registry) - 1} tasks, e.g. basic_arithmetic, chain_sum, leg_counting"
    raise UserError(f"{key}: reasoning-gym has no task {name!r}; {hint}")

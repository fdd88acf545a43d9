"""The single run's cross-key checks: problems that involve more than one key of a `Config`
(a source that needs a path, a reward kind that needs its pattern, bounds that must not cross,
[data] and [reward] keys that only the task kind reads), the tables inside sections
([reward.judge], [sft.data]), and whether a name can name a run folder.

Pure: no torch, no I/O. `sections.from_dict` runs them after every key was checked alone;
`cfg` is its `Config` (not imported here: sections imports this module).
"""

from __future__ import annotations

import re
import unicodedata

from retrain.algorithms.losses import config_problems
from retrain.config.cost_section import cost_issues
from retrain.config.distributed_section import distributed_issues
from retrain.config.judge_section import judge_issues
from retrain.config.schema import MAX_COMPLETIONS, ConfigIssue, show
from retrain.config.sft_section import sft_issues


def cross_checks(cfg) -> list[ConfigIssue]:
    """Problems that involve more than one key."""
    issues = _task_conflicts(cfg)
    if not cfg.model.name.strip():  # "" would resolve to the config's own folder
        issues.append(ConfigIssue("model.name", "is empty; give a built-in name ("
                                  "smollm2-135m-instruct, tiny-random), a Hugging Face id or a "
                                  "local model folder"))
    problem = run_name_problem(cfg.logging.run_name)
    if cfg.logging.run_name and problem:
        issues.append(ConfigIssue("logging.run_name", problem))
    t = cfg.training
    if t.batch_size * t.group_size > MAX_COMPLETIONS:
        issues.append(ConfigIssue("training.batch_size", f"x training.group_size = "
                                  f"{t.batch_size * t.group_size:_} completions per step, more "
                                  f"than {MAX_COMPLETIONS:_}; lower batch_size or group_size"))
    if t.lr * t.weight_decay >= 1:
        issues.append(ConfigIssue("training.weight_decay", f"x training.lr = "
                                  f"{t.lr * t.weight_decay:.3g}: AdamW multiplies every weight "
                                  "by 1 - lr x weight_decay each step, which then flips its sign "
                                  "and grows it until the weights diverge; keep weight_decay "
                                  f"below 1 / lr = {1 / t.lr:.3g} (0.0 to 0.1 is usual)"))
    if t.max_steps_off_policy and cfg.backend.backend != "tinker":
        issues.append(ConfigIssue("training.max_steps_off_policy", "needs backend = 'tinker': "
                                  "the local backend samples and trains on the same device, one "
                                  "at a time, so overlap only makes samples stale; set it to 0"))
    be = cfg.backend
    if be.max_concurrent_min > be.max_concurrent_max:
        issues.append(ConfigIssue("backend.max_concurrent_min", f"({be.max_concurrent_min}) "
                                  "must be <= backend.max_concurrent_max "
                                  f"({be.max_concurrent_max})"))
    if 0 < be.fast_ratio_cap < 1:
        issues.append(ConfigIssue("backend.fast_ratio_cap", f"({be.fast_ratio_cap}) would cut "
                                  "on-policy tokens (ratio ~1); use 0 (off) or a cap >= 1, "
                                  "e.g. 2.0"))
    issues += _environment_conflicts(cfg)
    issues += _recipe_conflicts(cfg)
    issues += _finetune_conflicts(cfg)
    issues += distributed_issues(cfg)
    issues += [ConfigIssue(k, m) for k, m in config_problems(cfg.algorithm, cfg.backend.backend)]
    bp = cfg.backpressure
    if bp.min_batch_size > bp.max_batch_size:
        issues.append(ConfigIssue("backpressure.min_batch_size", f"({bp.min_batch_size}) must be "
                                  f"<= backpressure.max_batch_size ({bp.max_batch_size})"))
    if bp.enabled and bp.increase_margin <= 0:
        issues.append(ConfigIssue("backpressure.increase_margin", "must be > 0 when enabled"))
    return issues


def table_checks(cfg, issues: list[ConfigIssue]) -> list[ConfigIssue]:
    """The tables inside sections, [reward.judge] (only when [reward] itself is sound:
    `issues` are those found so far) and [sft] with its [sft.data]."""
    judge = [] if any(i.key.startswith("reward.") for i in issues) else judge_issues(cfg.reward)
    cost = [] if any(i.key.startswith("cost.") for i in issues) else \
        cost_issues(cfg.cost, cfg.training)
    return judge + sft_issues(cfg.sft, cfg.training) + cost



def _task_conflicts(cfg) -> list[ConfigIssue]:
    """[data] and [reward] keys that need each other."""
    issues = []
    if cfg.data.source == "jsonl" and not cfg.data.path:
        issues.append(ConfigIssue("data.path", "data.source = 'jsonl' needs data.path = "
                                  "'file.jsonl'"))
    if cfg.data.source == "hf" and not cfg.data.path:
        issues.append(ConfigIssue("data.path", "data.source = 'hf' needs data.path = a "
                                  "dataset folder, a parquet file or a cached dataset name"))
    bad_ops = [o for o in cfg.data.operations if o not in ("+", "-", "*")]
    if bad_ops or not cfg.data.operations:
        issues.append(ConfigIssue("data.operations", "expected a non-empty list drawn from "
                                  f"'+', '-', '*', got {show(cfg.data.operations)}"))
    if cfg.reward.type == "custom" and not cfg.reward.function:
        issues.append(ConfigIssue("reward.function", "reward.type = 'custom' needs "
                                  "reward.function = 'module:function' or 'file.py:function'"))
    if cfg.reward.type == "format":
        if not cfg.reward.pattern:
            issues.append(ConfigIssue("reward.pattern", "reward.type = 'format' needs "
                                      "reward.pattern = a regex"))
        else:
            try:
                re.compile(cfg.reward.pattern)
            except re.error as exc:
                issues.append(ConfigIssue("reward.pattern", f"is not a valid regex: {exc}"))
    return issues


def _recipe_conflicts(cfg) -> list[ConfigIssue]:
    """Keys of a training recipe that contradict each other (or do nothing where set)."""
    t, issues = cfg.training, []
    if t.mini_batches > t.batch_size and not cfg.backpressure.enabled:
        issues.append(ConfigIssue("training.mini_batches", f"({t.mini_batches}) is more than "
                                  f"training.batch_size ({t.batch_size}): a mini-batch holds "
                                  "whole groups; lower mini_batches"))
    if t.min_lr_ratio and t.lr_schedule == "constant":
        issues.append(ConfigIssue("training.min_lr_ratio", "applies to training.lr_schedule "
                                  "= 'linear' or 'cosine'; set one, or remove min_lr_ratio"))
    issues += _kl_conflicts(cfg)
    if t.max_refill_rounds != 4 and not t.refill:
        issues.append(ConfigIssue("training.max_refill_rounds", "applies with training.refill "
                                  "= true; set it, or remove max_refill_rounds"))
    r = cfg.reward
    if r.overlong_penalty != 1.0 and not r.overlong_buffer:
        issues.append(ConfigIssue("reward.overlong_penalty", "applies with "
                                  "reward.overlong_buffer > 0; set it, or remove overlong_penalty"))
    if r.overlong_buffer > t.max_tokens:
        issues.append(ConfigIssue("reward.overlong_buffer", f"({r.overlong_buffer}) is more than "
                                  f"training.max_tokens ({t.max_tokens}); the buffer ends at "
                                  "the limit"))
    if r.overlong_buffer and cfg.environment.tools:
        issues.append(ConfigIssue("reward.overlong_buffer", "shapes one-turn completions; "
                                  "environment.tools makes episodes of several turns"))
    return issues


def _finetune_conflicts(cfg) -> list[ConfigIssue]:
    """`model.finetune = "full"` trains every weight in this process: not on Tinker (LoRA
    only), and not through the fast sampler (it merges LoRA layers into fixed buffers)."""
    if cfg.model.finetune != "full":
        return []
    if cfg.backend.backend == "tinker":
        return [ConfigIssue("model.finetune", "= 'full' needs backend = 'local': Tinker trains "
                            "LoRA adapters only; use finetune = 'lora' with backend.backend = "
                            "'tinker'")]
    if cfg.backend.sampler == "fast":
        return [ConfigIssue("backend.sampler", "= 'fast' merges LoRA into fixed buffers; "
                            "model.finetune = 'full' has no LoRA: use sampler = 'exact' or "
                            "'auto'")]
    return []


def _kl_conflicts(cfg) -> list[ConfigIssue]:
    a, issues = cfg.algorithm, []
    if not a.kl_coef:
        for key, default in (("kl_in", "reward"), ("kl_estimator", "k1")):
            if getattr(a, key) != default:
                issues.append(ConfigIssue(f"algorithm.{key}", "needs algorithm.kl_coef > 0 "
                                          "(the KL term is off); set kl_coef, or remove "
                                          f"{key}"))
    elif a.kl_in == "loss" and cfg.backend.backend == "tinker":
        issues.append(ConfigIssue("algorithm.kl_in", "= 'loss' needs backend = 'local': "
                                  "Tinker's losses take no reference log-probs; use kl_in = "
                                  "'reward'"))
    return issues


# [data] keys that describe the task kind's problems (eval_size also counts held-out episodes)
_TASK_DATA_KEYS = ("source", "path", "digits", "operations", "countdown_numbers", "size",
                   "shuffle", "instruction", "chat_template", "split", "prompt_field",
                   "answer_field", "messages_field")


def _environment_conflicts(cfg) -> list[ConfigIssue]:
    """[data] and [reward] describe the task kind; another kind brings its own questions."""
    env = cfg.environment
    if env.kind == "task":
        return []
    issues = []
    # The section's defaults from its own class (sections is not imported here).
    data, default = cfg.data, type(cfg.data)()
    for key in _TASK_DATA_KEYS:
        if getattr(data, key) != getattr(default, key):
            issues.append(ConfigIssue(f"data.{key}", f"is for environment.kind = 'task'; kind "
                                      f"{env.kind!r} asks its own questions: remove it (only "
                                      "data.eval_size, the held-out episodes, applies)"))
    if cfg.reward != type(cfg.reward)():
        issues.append(ConfigIssue("reward.type", f"[reward] scores the task kind; kind "
                                  f"{env.kind!r} is scored by its environment: remove [reward]"))
    if env.kind == "python" and not env.factory:
        issues.append(ConfigIssue("environment.factory", "environment.kind = 'python' needs "
                                  "environment.factory = 'my_env.py:MyEnv'"))
    return issues


def run_name_problem(name: str) -> str:
    """Why `name` cannot name a run folder inside logging.log_dir ('' when it can): the
    folder must be a child of log_dir, never log_dir itself, its parent or an absolute path."""
    if name in ("", ".", "..") or "/" in name or "\\" in name:
        return (f"{show(name)} is not a plain folder name: it must not be empty, '.' or '..' "
                "nor hold '/' or '\\' (the run folder is logging.log_dir/<run_name>); use "
                "logging.log_dir to pick where runs go")
    odd = next((ch for ch in name if unicodedata.category(ch) in ("Cc", "Zl", "Zp")), None)
    if odd is not None:  # a newline or escape would break every line that shows the run
        return f"{show(name)} holds a control character ({odd!r}); use a plain one-line name"
    return ""

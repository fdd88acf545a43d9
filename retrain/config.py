"""Typed configuration: sections, TOML load, CLI overrides, validation, lossless dump.

Pure: no torch, no SDK. The only I/O is reading the config file in `load_config`.
Every key's default, allowed values and one-line meaning live in the field metadata,
so validation, `explain` and the README's reference share one source of truth.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrain import toml_io
from retrain.errors import UserError

# ---------------------------------------------------------------------------- size bounds

# What is physically meaningful, so that an absurd value (batch_size = 10**12) is a clear
# error before anything allocates, not a run that builds a 10**12-element list. Each bound is
# far beyond what today's largest runs use (a 1M-token context, 64k prompts per step).
MAX_BATCH = 65_536                # prompts per step
MAX_GROUP = 4_096                 # completions per prompt
MAX_COMPLETIONS = 1_048_576       # batch_size x group_size: completions sampled per step
MAX_TOKENS = 1_048_576            # new tokens per completion
MAX_STEPS = 100_000_000
MAX_PROBLEMS = 10_000_000         # generated problems held in memory
MAX_THREADS = 4_096
MAX_LORA_RANK = 65_536
MAX_WORKERS = 4_096               # campaign workers / concurrent API calls
MAX_WAIT_S = 604_800.0            # timeouts and gaps: a week (beyond, waits overflow timers)

# ---------------------------------------------------------------------------- schema helpers


def opt(default: Any, help: str, *, choices: tuple | None = None, lo: float | None = None,
        hi: float | None = None, lo_open: bool = False, factory: bool = False) -> Any:
    """A config field with its meaning and allowed values attached."""
    meta = {"help": help, "choices": choices, "lo": lo, "hi": hi, "lo_open": lo_open}
    if factory:
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    name: str = opt("smollm2-135m-instruct",
                    "built-in short name, Hugging Face id (from the local cache) or local folder")
    dtype: str = opt("auto", "weights dtype; auto = bfloat16 where the GPU/CPU computes it "
                     "natively, else float32; loss math always runs in float32",
                     choices=("auto", "bfloat16", "float32", "float16"))
    device: str = opt("auto", "auto picks cuda, then mps, then cpu",
                      choices=("auto", "cpu", "cuda", "mps"))
    threads: int = opt(0, "torch CPU threads; 0 = all cores", lo=0, hi=MAX_THREADS)
    lora_rank: int = opt(8, "LoRA rank", lo=1, hi=MAX_LORA_RANK)
    lora_alpha: float = opt(16.0, "LoRA alpha (scale = alpha / rank)", lo=0, lo_open=True)
    lora_dropout: float = opt(0.0, "LoRA dropout", lo=0, hi=0.99)
    lora_target_modules: list[str] = opt(
        [], "modules that get LoRA; empty = the architecture's attention projections",
        factory=True)


@dataclass
class DataConfig:
    source: str = opt("arithmetic", "prompt source: built-in task or a JSONL file",
                      choices=("arithmetic", "countdown", "jsonl"))
    path: str = opt("", "JSONL file ({\"prompt\", \"answer\"} per line), relative to the "
                    "config file")
    digits: int = opt(1, "arithmetic: digits per operand", lo=1, hi=9)
    operations: list[str] = opt(["+"], "arithmetic: operations drawn from + - *", factory=True)
    countdown_numbers: int = opt(3, "countdown: how many numbers are given", lo=2, hi=6)
    size: int = opt(5000, "built-in tasks: number of generated training problems", lo=1,
                    hi=MAX_PROBLEMS)
    eval_size: int = opt(64, "held-out problems for evaluation (0 = no eval split)", lo=0,
                         hi=MAX_PROBLEMS)
    shuffle: bool = opt(True, "seeded shuffle of the training problems each epoch")
    instruction: str = opt(
        "End your reply with the result written as \\boxed{result}, e.g. 3 + 4 = 7, so \\boxed{7}.",
        "appended to every prompt; a worked example helps small models box their answer")
    chat_template: bool = opt(True, "render prompts with the tokenizer's chat template")


@dataclass
class RewardConfig:
    type: str = opt("match", "how completions are scored",
                    choices=("match", "math", "format", "custom"))
    pattern: str = opt("", "format: a regex a completion must contain to score 1")
    function: str = opt("", "custom: 'module:function' or 'path/to/file.py:function'")
    timeout_s: float = opt(5.0, "per-completion limit; a slow or failing scorer gives 0",
                           lo=0, lo_open=True, hi=MAX_WAIT_S)
    params: dict = opt({}, "free-form keyword arguments passed to a custom reward", factory=True)


@dataclass
class AlgorithmConfig:
    advantage: str = opt("grpo", "group advantage estimator",
                         choices=("grpo", "dr_grpo", "rloo", "maxrl", "reinforce_pp"))
    std_scale: str = opt("group", "grpo: divide by the std of the group, the batch, or not at all",
                         choices=("group", "batch", "none"))
    loss: str = opt("importance_sampling", "policy loss",
                    choices=("importance_sampling", "ppo"))
    clip_eps: float = opt(0.2, "ppo: lower clip range (ratio >= 1 - clip_eps)", lo=0, hi=1)
    clip_eps_high: float = opt(0.2, "ppo: upper clip range (ratio <= 1 + clip_eps_high)", lo=0)


@dataclass
class TrainingConfig:
    seed: int = opt(42, "seed for data order, sampling and LoRA init", lo=0)
    batch_size: int = opt(8, "prompts per step", lo=1, hi=MAX_BATCH)
    group_size: int = opt(16, "completions per prompt", lo=1, hi=MAX_GROUP)
    max_tokens: int = opt(10240, "upper bound on new tokens per completion", lo=1,
                          hi=MAX_TOKENS)
    max_steps: int = opt(100, "training steps per run", lo=1, hi=MAX_STEPS)
    lr: float = opt(5e-5, "AdamW learning rate", lo=0, lo_open=True)
    beta1: float = opt(0.9, "AdamW beta1", lo=0, hi=0.999999)
    beta2: float = opt(0.95, "AdamW beta2", lo=0, hi=0.999999)
    adam_eps: float = opt(1e-8, "AdamW epsilon", lo=0, lo_open=True)
    weight_decay: float = opt(0.0, "AdamW decoupled weight decay", lo=0)
    grad_clip_norm: float = opt(1.0, "clip the gradient norm to this (0 = off)", lo=0)
    temperature: float = opt(1.0, "sampling temperature (also used for the trainer's log-probs)",
                             lo=0, lo_open=True)
    top_p: float = opt(1.0, "nucleus sampling; < 1 biases the importance ratio (see README)",
                       lo=0, hi=1, lo_open=True)
    micro_batch_size: int = opt(0, "sequences per forward/backward chunk (0 = automatic)", lo=0,
                                hi=MAX_COMPLETIONS)
    save_every: int = opt(10, "checkpoint every N steps (and always at the end; 0 = end only)",
                          lo=0, hi=MAX_STEPS)
    eval_every: int = opt(0, "greedy eval on the held-out split every N steps (0 = start and end)",
                          lo=0, hi=MAX_STEPS)
    max_steps_off_policy: int = opt(
        0, "tinker: 1 = sample the next step while this one trains (samples one update old); "
        "0 = on-policy", lo=0, hi=1)


@dataclass
class BackendConfig:
    backend: str = opt("local", "where sampling and training run", choices=("local", "tinker"))
    max_concurrent: int = opt(4, "campaign-wide cap on concurrent remote API calls", lo=1,
                              hi=MAX_WORKERS)
    base_url: str = opt("", "tinker: service URL (default: $TINKER_BASE_URL or the SDK's)")
    request_timeout_s: float = opt(600.0, "tinker: deadline for one API call", lo=0, lo_open=True,
                                   hi=MAX_WAIT_S)
    options: dict = opt({}, "free-form backend options", factory=True)


@dataclass
class BackpressureConfig:
    enabled: bool = opt(False, "let the USL controller pick the batch size")
    warmup_steps: int = opt(10, "steps to collect before fitting", lo=0, hi=MAX_STEPS)
    ema_decay: float = opt(0.9, "EMA decay for throughput smoothing", lo=0, hi=0.999999)
    throttle_margin: float = opt(0.85, "target fraction of p* (safe operating point)",
                                 lo=0, hi=1, lo_open=True)
    increase_margin: float = opt(0.5, "hysteresis gap to prevent oscillation", lo=0, hi=1)
    min_batch_size: int = opt(1, "floor for batch size recommendations", lo=1, hi=MAX_BATCH)
    max_batch_size: int = opt(64, "ceiling for batch size recommendations", lo=1, hi=MAX_BATCH)
    peak_gflops: float = opt(0.0, "hardware peak GFLOP/s (enables roofline classification)", lo=0)
    peak_bw_gb_s: float = opt(0.0, "hardware peak memory bandwidth in GB/s", lo=0)
    lr_scaling: str = opt("sqrt", "scale training.lr with batch_size / training.batch_size "
                          "when the controller changes the batch (sqrt suits Adam)",
                          choices=("none", "sqrt", "linear"))
    objective: str = opt("throughput", "throughput = largest fast batch; goodput = also bounded "
                         "by the statistical efficiency of larger batches (gradient noise scale)",
                         choices=("throughput", "goodput"))


@dataclass
class Condition:
    """One campaign condition: a name and dotted-key overrides of any config key."""

    name: str = ""
    overrides: dict = field(default_factory=dict)


@dataclass
class CampaignConfig:
    name: str = opt("", "campaign folder name under log_dir (default: the TOML file's stem)")
    seeds: list[int] = opt([], "one run per seed per condition", factory=True)
    parallel: bool = opt(False, "run several workers at once")
    max_workers: int = opt(2, "workers alive at once when parallel (0 = all)", lo=0,
                           hi=MAX_WORKERS)
    stagger_seconds: float = opt(5.0, "minimum gap between worker launches", lo=0, hi=MAX_WAIT_S)
    max_retries: int = opt(1, "extra attempts for a failed run on re-launch", lo=0, hi=1000)
    conditions: list[Condition] = opt([], "[[campaign.conditions]]: name + dotted-key overrides",
                                      factory=True)
    grid: dict = opt({}, "[campaign.grid]: dotted key -> list of values (cartesian product)",
                     factory=True)
    executor: str = opt("local", "where runs execute: local processes, or a Ray cluster",
                        choices=("local", "ray"))
    ray_address: str = opt("", "ray: cluster address ('' = $RAY_ADDRESS or a running cluster, "
                           "else start one here)")
    run_resources: dict = opt({}, "ray: resources per run, {cpu = N, gpu = M} (default: cpu = "
                              "model.threads or 1, gpu = 1 when the model runs on cuda)",
                              factory=True)


@dataclass
class LoggingConfig:
    log_dir: str = opt("logs", "where runs and campaigns write, relative to the working folder")
    run_name: str = opt("", "run folder name (default: the TOML file's stem)")
    wandb_project: str = opt("", "log to Weights & Biases under this project (needs wandb)")
    tensorboard: bool = opt(False, "also write TensorBoard event files (needs tensorboard)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    backpressure: BackpressureConfig = field(default_factory=BackpressureConfig)
    campaign: CampaignConfig = field(default_factory=CampaignConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def is_campaign(self) -> bool:
        """A campaign expands into several runs; anything else is a single run."""
        c = self.campaign
        return bool(c.conditions or c.grid or c.seeds)


SECTIONS: dict[str, type] = dict(typing.get_type_hints(Config))


def section_fields(section: str) -> dict[str, dataclasses.Field]:
    """The fields of one section, by key."""
    return {f.name: f for f in dataclasses.fields(SECTIONS[section])}


def field_type(section: str, key: str) -> Any:
    """The annotated type of `section.key` (list[str], int, dict, ...)."""
    return _section_hints(section)[key]


@functools.cache
def _section_hints(section: str) -> dict[str, Any]:
    return typing.get_type_hints(SECTIONS[section])


# ---------------------------------------------------------------------------- errors


@dataclass
class ConfigIssue:
    """One problem found in a config: where, what, and how to fix it."""

    key: str
    message: str

    def render(self, source: str) -> str:
        where = f"{source}: {self.key}" if self.key else source
        return f"{where}: {self.message}"


class ConfigError(UserError):
    """Every problem found in one config file, reported together."""

    def __init__(self, source: str, issues: list[ConfigIssue]):
        self.source = source
        self.issues = issues
        super().__init__(self.render())

    def render(self) -> str:
        if len(self.issues) == 1:
            return self.issues[0].render(self.source)
        lines = [f"{self.source}: {len(self.issues)} problems"]
        lines += ["  - " + (f"{i.key}: {i.message}" if i.key else i.message) for i in self.issues]
        return "\n".join(lines)


def _did_you_mean(word: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _all_keys() -> list[str]:
    return [f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _key_hint(section: str | None, key: str) -> str:
    """Did-you-mean for an unknown key: a close key in the same section, else the section
    where that key really lives, else any close `section.key`."""
    if section in SECTIONS:
        close = difflib.get_close_matches(key, list(section_fields(section)), n=1, cutoff=0.6)
        if close:
            return f" (did you mean '{section}.{close[0]}'?)"
    homes = [k for k in _all_keys() if k.split(".", 1)[1] == key]
    if homes:
        return f" (did you mean '{homes[0]}'? '{key}' lives in [{homes[0].split('.')[0]}])"
    bare = {k.split(".", 1)[1]: k for k in _all_keys()}
    close = difflib.get_close_matches(key, list(bare), n=1, cutoff=0.75)
    return f" (did you mean '{bare[close[0]]}'?)" if close else ""


def _show(value: Any) -> str:
    return toml_io.format_value(value) if toml_io.is_tomlable(value) else repr(value)


# ---------------------------------------------------------------------------- value checking


_TYPE_NAMES = {str: ("a string", "strings"), int: ("an integer", "integers"),
               float: ("a number", "numbers"), bool: ("true or false", "booleans"),
               dict: ("a table", "tables")}


def _type_name(tp: Any) -> str:
    """'an integer', 'a list of strings', ...: what a key expects, in words."""
    if typing.get_origin(tp) is list:
        return "a list of " + _TYPE_NAMES[typing.get_args(tp)[0]][1]
    return _TYPE_NAMES.get(tp, (str(tp), ""))[0]


def check_value(section: str, key: str, value: Any) -> tuple[Any, str | None]:
    """Coerce `value` to the field's type and check its range; return (value, problem)."""
    f = section_fields(section)[key]
    tp = field_type(section, key)
    shown = _show(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if typing.get_origin(tp) is list:
        inner = typing.get_args(tp)[0]
        if not isinstance(value, list) or not all(_is_type(v, inner) for v in value):
            return value, f"expected {_type_name(tp)}, got {shown}"
        if inner is float:
            value = [float(v) for v in value]
    elif not _is_type(value, tp):
        return value, f"expected {_type_name(tp)}, got {shown}"
    if tp is float and not math.isfinite(value):
        return value, f"must be a finite number, got {shown}"
    if tp is int and abs(value) >= 2**63:
        return value, f"is out of range (a 64-bit integer), got {shown}"
    if not toml_io.is_tomlable(value):
        return value, f"cannot be stored in TOML (invalid text?), got {shown}"
    meta = f.metadata
    if meta.get("choices") and value not in meta["choices"]:
        allowed = ", ".join(_show(c) for c in meta["choices"])
        hint = _did_you_mean(str(value), meta["choices"])
        return value, f"{shown} is not allowed; use one of {allowed}{hint}"
    lo, hi = meta.get("lo"), meta.get("hi")
    numeric = isinstance(value, (int, float))
    if numeric and lo is not None and (value < lo or (meta.get("lo_open") and value <= lo)):
        op = ">" if meta.get("lo_open") else ">="
        return value, f"must be {op} {format_bound(lo)}, got {shown}"
    if hi is not None and isinstance(value, (int, float)) and value > hi:
        return value, f"must be <= {format_bound(hi)}, got {shown}"
    return value, None


def format_bound(x: float) -> str:
    """A range bound as written in messages and docs: 1, not 1.0."""
    return str(int(x)) if float(x).is_integer() else str(x)


def _is_type(value: Any, tp: Any) -> bool:
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if tp is dict:
        return isinstance(value, dict)
    return isinstance(value, tp)


# ---------------------------------------------------------------------------- building


def from_dict(raw: dict, source: str = "<config>") -> Config:
    """Validate a raw TOML-shaped dict into a Config, or raise ConfigError with every issue."""
    issues: list[ConfigIssue] = []
    cfg = Config()
    for name, body in raw.items():
        if name not in SECTIONS and not isinstance(body, dict):
            issues.append(ConfigIssue(name, "top-level keys are not allowed; every key belongs "
                                      f"to a section{_key_hint(None, name)}"))
            continue
        if name not in SECTIONS:
            hint = _did_you_mean(name, SECTIONS)
            issues.append(ConfigIssue(f"[{name}]", f"unknown section{hint}; sections are "
                                      + ", ".join(SECTIONS)))
            continue
        if not isinstance(body, dict):
            issues.append(ConfigIssue(name, f"must be a table ([{name}]), got {_show(body)}"))
            continue
        section = getattr(cfg, name)
        for key, value in body.items():
            _set_key(section, name, key, value, issues)
    issues += cross_checks(cfg)
    if issues:
        raise ConfigError(source, issues)
    return cfg


def _set_key(section: Any, name: str, key: str, value: Any, issues: list[ConfigIssue]) -> None:
    fields = section_fields(name)
    if key not in fields:
        issues.append(ConfigIssue(f"{name}.{key}", f"unknown key{_key_hint(name, key)}; "
                                  f"[{name}] takes " + ", ".join(fields)))
        return
    if name == "campaign" and key == "conditions":
        setattr(section, key, _conditions(value, issues))
        return
    if name == "campaign" and key == "grid":
        setattr(section, key, _grid(value, issues))
        return
    value, problem = check_value(name, key, value)
    if problem:
        issues.append(ConfigIssue(f"{name}.{key}", problem))
    else:
        setattr(section, key, copy.deepcopy(value))


def flatten(table: dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; keys that already hold dots are kept whole."""
    out: dict[str, Any] = {}
    for k, v in table.items():
        full = f"{prefix}{k}"
        if isinstance(v, dict) and _dict_descends(full):
            out.update(flatten(v, full + "."))
        else:
            out[full] = v
    return out


def diff(before: dict, after: dict) -> dict[str, tuple[Any, Any]]:
    """Key-by-key differences of two config tables: dotted key -> (before, after), sorted."""
    a, b = flatten(before), flatten(after)
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


def _dict_descends(dotted: str) -> bool:
    """Nested tables in overrides descend until they reach a schema key."""
    parts = dotted.split(".")
    if len(parts) == 1:
        return parts[0] in SECTIONS
    if parts[0] in SECTIONS and len(parts) == 2:
        fields = section_fields(parts[0])
        return parts[1] not in fields
    return False


def _conditions(value: Any, issues: list[ConfigIssue]) -> list[Condition]:
    if not isinstance(value, list) or not all(isinstance(c, dict) for c in value):
        issues.append(ConfigIssue("campaign.conditions", "must be an array of tables "
                                  "([[campaign.conditions]]), got " + _show(value)))
        return []
    out = []
    for i, table in enumerate(value):
        name = table.get("name", "")
        where = f"campaign.conditions[{i}]"
        if not isinstance(name, str):
            issues.append(ConfigIssue(f"{where}.name", f"expected a string, got {_show(name)}"))
            name = ""
        overrides = flatten({k: v for k, v in table.items() if k != "name"})
        for key, val in overrides.items():
            problem = check_override(key, val)
            if problem:
                issues.append(ConfigIssue(f"{where}.\"{key}\"", problem))
        out.append(Condition(name=name, overrides=overrides))
    return out


def _grid(value: Any, issues: list[ConfigIssue]) -> dict:
    if not isinstance(value, dict):
        issues.append(ConfigIssue("campaign.grid", f"must be a table, got {_show(value)}"))
        return {}
    grid = flatten(value)
    for key, vals in grid.items():
        if not isinstance(vals, list) or not vals:
            issues.append(ConfigIssue(f"campaign.grid.\"{key}\"",
                                      f"expected a non-empty list of values, got {_show(vals)}"))
            continue
        for v in vals:
            problem = check_override(key, v)
            if problem:
                issues.append(ConfigIssue(f"campaign.grid.\"{key}\"", problem))
                break
    return grid


def split_key(dotted: str) -> tuple[str, str, list[str]] | str:
    """'backend.options.a.b' -> ('backend', 'options', ['a', 'b']); a message if it is no key."""
    parts = dotted.split(".")
    if len(parts) < 2 or not all(parts):
        return f"'{dotted}' is not a 'section.key' name"
    section, key, rest = parts[0], parts[1], parts[2:]
    if section not in SECTIONS:
        return f"unknown section '{section}'{_did_you_mean(section, SECTIONS)}"
    fields = section_fields(section)
    if key not in fields:
        return f"unknown key '{section}.{key}'{_key_hint(section, key)}"
    if rest and field_type(section, key) is not dict:
        return f"'{section}.{key}' is not a table, so '{dotted}' names nothing"
    if section == "campaign":
        return "campaign keys cannot be overridden per run"
    return section, key, rest


def check_override(dotted: str, value: Any) -> str | None:
    """The problem with overriding `dotted` by `value`, or None when it is fine."""
    parsed = split_key(dotted)
    if isinstance(parsed, str):
        return parsed
    section, key, rest = parsed
    if rest:
        return None if toml_io.is_tomlable(value) else f"cannot store {value!r}"
    return check_value(section, key, value)[1]


def apply_overrides(raw: dict, overrides: dict[str, Any]) -> dict:
    """Return a copy of the raw dict with dotted-key overrides applied (free-form tables too).

    A table value merges into the table it overrides (recursively), so a condition that sets
    one backend option keeps the others."""
    out = copy.deepcopy(raw)
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node = out
        for p in parts[:-1]:
            if p not in node:
                node[p] = {}
            if not isinstance(node[p], dict):
                break  # the file holds a non-table here; validation reports it
            node = node[p]
        else:
            node[parts[-1]] = _merged(node.get(parts[-1]), value)
    return out


def _merged(old: Any, new: Any) -> Any:
    if isinstance(old, dict) and isinstance(new, dict):
        out = copy.deepcopy(old)
        for k, v in new.items():
            out[k] = _merged(out.get(k), v)
        return out
    return copy.deepcopy(new)


RUN_RESOURCE_KEYS = ("cpu", "gpu")


def _run_resources_issues(value: dict) -> list[ConfigIssue]:
    issues = []
    for key, amount in value.items():
        where = f"campaign.run_resources.{key}"
        if key not in RUN_RESOURCE_KEYS:
            issues.append(ConfigIssue(where, "unknown resource; run_resources takes cpu and gpu, "
                                      "e.g. run_resources = {cpu = 2, gpu = 1}"))
        elif isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount < 0:
            issues.append(ConfigIssue(where, f"expected a number >= 0, got {_show(amount)}"))
    return issues


def run_resources(cfg: Config, cluster_gpus: float = 0.0) -> dict[str, float]:
    """What one run asks Ray for: [campaign] run_resources, with defaults derived from the run
    (cpu = model.threads or 1; gpu = 1 when the model runs on cuda, i.e. device = "cuda", or
    "auto" on a cluster that has GPUs; a remote backend needs none)."""
    res = cfg.campaign.run_resources
    on_cuda = cfg.model.device == "cuda" or (cfg.model.device == "auto" and cluster_gpus > 0)
    gpu = 1.0 if on_cuda and cfg.backend.backend == "local" else 0.0
    return {"cpu": float(res.get("cpu", cfg.model.threads or 1)), "gpu": float(res.get("gpu", gpu))}


def cross_checks(cfg: Config) -> list[ConfigIssue]:
    """Problems that involve more than one key."""
    issues = []
    if cfg.data.source == "jsonl" and not cfg.data.path:
        issues.append(ConfigIssue("data.path", "data.source = 'jsonl' needs data.path = "
                                  "'file.jsonl'"))
    bad_ops = [o for o in cfg.data.operations if o not in ("+", "-", "*")]
    if bad_ops or not cfg.data.operations:
        issues.append(ConfigIssue("data.operations", "expected a non-empty list drawn from "
                                  f"'+', '-', '*', got {_show(cfg.data.operations)}"))
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
    t = cfg.training
    if t.batch_size * t.group_size > MAX_COMPLETIONS:
        issues.append(ConfigIssue("training.batch_size", f"x training.group_size = "
                                  f"{t.batch_size * t.group_size:_} completions per step, more "
                                  f"than {MAX_COMPLETIONS:_}; lower batch_size or group_size"))
    if t.max_steps_off_policy and cfg.backend.backend != "tinker":
        issues.append(ConfigIssue("training.max_steps_off_policy", "needs backend = 'tinker': "
                                  "the local backend samples and trains on the same device, one "
                                  "at a time, so overlap only makes samples stale; set it to 0"))
    bp = cfg.backpressure
    if bp.min_batch_size > bp.max_batch_size:
        issues.append(ConfigIssue("backpressure.min_batch_size", f"({bp.min_batch_size}) must be "
                                  f"<= backpressure.max_batch_size ({bp.max_batch_size})"))
    if bp.enabled and bp.increase_margin <= 0:
        issues.append(ConfigIssue("backpressure.increase_margin", "must be > 0 when enabled"))
    names = [c.name for c in cfg.campaign.conditions if c.name]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        issues.append(ConfigIssue("campaign.conditions", "condition names must be unique; "
                                  "repeated: " + ", ".join(dupes)))
    if len(set(cfg.campaign.seeds)) != len(cfg.campaign.seeds):
        issues.append(ConfigIssue("campaign.seeds", "seeds must be unique, got "
                                  + _show(cfg.campaign.seeds)))
    if any(s < 0 for s in cfg.campaign.seeds):
        issues.append(ConfigIssue("campaign.seeds", "seeds must be >= 0, got "
                                  + _show(cfg.campaign.seeds)))
    issues += _run_resources_issues(cfg.campaign.run_resources)
    return issues


# ---------------------------------------------------------------------------- loading


def read_toml_file(path: str | Path) -> dict:
    """Read and parse a TOML file; every failure is a one-line ConfigError."""
    p = Path(path)
    src = str(path)
    if not p.exists():
        raise ConfigError(src, [ConfigIssue("", "no such file; create one with "
                                            "`retrain init --template quickstart`")])
    if p.is_dir():
        raise ConfigError(src, [ConfigIssue("", "is a directory, not a TOML file")])
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(src, [ConfigIssue("", f"cannot be read: {exc.strerror}")]) from None
    return parse_toml(data, src)


def parse_toml(data: bytes | str, source: str) -> dict:
    """Parse TOML text, turning syntax errors into file:line:column messages."""
    if isinstance(data, bytes):
        if b"\x00" in data:
            raise ConfigError(source, [ConfigIssue("", "is a binary file, not TOML text")])
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(source, [ConfigIssue("", "is not UTF-8 text, so not TOML")]) from None
    if not data.strip():
        raise ConfigError(source, [ConfigIssue("", "is empty; start from "
                                               "`retrain init --template quickstart`")])
    try:
        return toml_io.loads(data)
    except toml_io.TOMLDecodeError as exc:
        msg = str(exc)
        m = re.search(r"\(at line (\d+), column (\d+)\)", msg)
        if m:
            reason, where = msg[: m.start()].strip(), f"{m.group(1)}:{m.group(2)}"
        elif "(at end of document)" in msg:
            lines = data.rstrip().split("\n")
            reason = msg.replace("(at end of document)", "").strip() + " at the end of the file"
            where = f"{len(lines)}:{len(lines[-1]) + 1}"
        else:
            raise ConfigError(source, [ConfigIssue("", f"invalid TOML: {msg}")]) from None
        raise ConfigError(f"{source}:{where}",
                          [ConfigIssue("", f"invalid TOML: {reason}")]) from None


def parse_cli_value(section: str, key: str, text: str) -> Any:
    """Type a `--set` value by the schema: string keys take the text as is (or a quoted TOML
    string), every other key parses it as a TOML value (1e-4, true, [1, 2], {a = 1})."""
    parsed = _toml_value(text)
    if field_type(section, key) is str:
        return parsed if isinstance(parsed, str) else text
    return text if parsed is _NOT_TOML else parsed


_NOT_TOML = object()


def _toml_value(text: str) -> Any:
    try:
        return toml_io.loads(f"v = {text}")["v"]
    except toml_io.TOMLDecodeError:
        return _NOT_TOML


def parse_set_args(items: list[str], source: str = "command line") -> dict[str, Any]:
    """Turn ['training.lr=1e-4', ...] into typed dotted-key overrides, or raise ConfigError
    naming every bad item."""
    out: dict[str, Any] = {}
    issues = []
    for item in items:
        dotted, eq, text = (s.strip() for s in item.partition("="))
        if not eq or not dotted:
            issues.append(ConfigIssue(f"--set {item}", "expected section.key=value, "
                                      "e.g. --set training.lr=1e-4"))
            continue
        parsed = _cli_key(dotted)
        if isinstance(parsed, str):
            issues.append(ConfigIssue(f"--set {dotted}", parsed))
            continue
        section, key, rest = parsed
        if rest:  # inside a free-form table: any TOML value, else the text itself
            value = _toml_value(text)
            value = text if value is _NOT_TOML else value
        else:
            value = parse_cli_value(section, key, text)
        problem = _cli_override_problem(dotted, value)
        if problem:
            issues.append(ConfigIssue(f"--set {dotted}", problem))
        out[dotted] = value
    if issues:
        raise ConfigError(source, issues)
    return out


def _cli_key(dotted: str) -> tuple[str, str, list[str]] | str:
    """Like split_key, but the command line may also set [campaign] keys."""
    parsed = split_key(dotted)
    parts = dotted.split(".")
    if isinstance(parsed, str) and parts[0] == "campaign" and len(parts) == 2 and parts[1]:
        if parts[1] in section_fields("campaign"):
            return "campaign", parts[1], []
        return f"unknown key '{dotted}'{_key_hint('campaign', parts[1])}"
    return parsed


def _cli_override_problem(dotted: str, value: Any) -> str | None:
    parsed = _cli_key(dotted)
    if isinstance(parsed, str):
        return parsed
    if parsed[0] == "campaign":
        if parsed[1] in ("conditions", "grid"):
            return f"set campaign.{parsed[1]} in the TOML file, not on the command line"
        return check_value("campaign", parsed[1], value)[1]
    return check_override(dotted, value)


# Command-line shortcuts for the most common overrides.
SHORTCUTS = {"--seed": "training.seed", "--max-steps": "training.max_steps",
             "--log-dir": "logging.log_dir", "--executor": "campaign.executor"}


def command_line_overrides(sets: list[str], shortcuts: dict[str, Any]) -> dict[str, Any]:
    """`--set` items plus shortcut flags ({'--seed': 3, ...}; None = not given) as validated
    dotted-key overrides; a shortcut wins over a --set of the same key."""
    try:
        out, issues = parse_set_args(list(sets)), []
    except ConfigError as exc:
        out, issues = {}, list(exc.issues)
    for flag, value in shortcuts.items():
        if value is None:
            continue
        dotted = SHORTCUTS[flag]
        section, key = dotted.split(".")
        problem = check_value(section, key, value)[1]
        if problem:
            issues.append(ConfigIssue(f"{flag} ({dotted})", problem))
        out[dotted] = value
    if issues:
        raise ConfigError("command line", issues)
    return out


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> Config:
    """Load, override and validate a config file; raise ConfigError naming every problem."""
    raw = read_toml_file(path)
    if overrides:
        raw = apply_overrides(raw, overrides)
    return from_dict(raw, str(path))


def loads_config(text: str, source: str = "<string>") -> Config:
    """Validate a config from TOML text."""
    return from_dict(parse_toml(text, source), source)


# ---------------------------------------------------------------------------- dumping


def to_dict(cfg: Config) -> dict:
    """The full config as a TOML-shaped dict (every key, defaults included)."""
    out: dict[str, Any] = {}
    for name in SECTIONS:
        section = getattr(cfg, name)
        body = {}
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if name == "campaign" and f.name == "conditions":
                value = [{"name": c.name, **c.overrides} for c in value]
            body[f.name] = copy.deepcopy(value)
        out[name] = body
    return out


def dumps_config(cfg: Config) -> str:
    """The resolved config as TOML that loads back to an equal Config."""
    return toml_io.dumps(to_dict(cfg))


def run_config(cfg: Config, **changes: Any) -> Config:
    """A copy of `cfg` with dotted-key changes applied and re-validated."""
    raw = apply_overrides(to_dict(cfg), changes)
    return from_dict(raw, "<run config>")


def describe_keys() -> list[tuple[str, str, Any, str]]:
    """(section, key, default, meaning) for every key: the README's reference table."""
    rows = []
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            help_text = f.metadata.get("help", "")
            choices = f.metadata.get("choices")
            if choices:
                help_text += " (" + " | ".join(choices) + ")"
            rows.append((name, f.name, default, help_text))
    return rows

"""The single run's configuration: typed sections, building one from a TOML-shaped dict
(`cross_checks` then checks what involves more than one key), dotted-key overrides and the
lossless dict form.

Pure: no torch, no SDK, no I/O (`config_file` reads the file; `campaign/plan` holds the
[campaign] table a file may add). Every key's default, allowed values and one-line meaning
live in the field metadata, so validation, `explain` and the README's reference share one
source of truth.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from retrain.algorithms.aggregation import AGGREGATIONS
from retrain.algorithms.losses import DEFAULT_DRO_BETA, TINKER_LOSS_FN_TYPES
from retrain.config.cost_section import CostConfig
from retrain.config.cross_checks import cross_checks, table_checks
from retrain.config.distributed_section import DistributedConfig
from retrain.config.merge import apply_overrides
from retrain.config.schema import (
    MAX_BATCH,
    MAX_COMPLETIONS,
    MAX_GROUP,
    MAX_LORA_RANK,
    MAX_PROBLEMS,
    MAX_STEPS,
    MAX_THREADS,
    MAX_TOKENS,
    MAX_TURNS,
    MAX_UPDATES,
    MAX_WAIT_S,
    MAX_WORKERS,
    ConfigError,
    ConfigIssue,
    check_field,
    fields_of,
    hints_of,
    opt,
    section_problem,
    set_field,
    unknown_key,
)
from retrain.config.sft_section import SftConfig

ALL_LINEAR = "all-linear"  # lora_target_modules: peft's word for every linear layer but the head


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
    finetune: str = opt("lora", "what trains: lora = a LoRA adapter (the lora_* keys); full = "
                        "every weight, with AdamW states for all: local backend only, memory "
                        "in retrain explain", choices=("lora", "full"))
    lora_rank: int = opt(8, "LoRA rank", lo=1, hi=MAX_LORA_RANK)
    lora_alpha: float = opt(16.0, "LoRA alpha (scale = alpha / rank)", lo=0, lo_open=True)
    lora_dropout: float = opt(0.0, "LoRA dropout", lo=0, hi=0.99)
    lora_target_modules: list[str] = opt(
        [], f"modules that get LoRA; [\"{ALL_LINEAR}\"] = every linear layer (attention and "
        "MLP); empty = the architecture's attention projections", factory=True)


@dataclass
class DataConfig:
    source: str = opt("arithmetic", "prompt source: built-in task, a JSONL file or a "
                      "Hugging Face dataset on this machine (hf)",
                      choices=("arithmetic", "countdown", "jsonl", "hf"))
    path: str = opt("", "jsonl: a file of {\"prompt\", \"answer\"} or {\"messages\", "
                    "\"answer\"} lines; hf: a dataset folder, a parquet/arrow/json/csv file or "
                    "a name in the local Hugging Face cache (never downloaded); relative to the "
                    "config file")
    split: str = opt("train", "hf: the dataset split the problems come from")
    prompt_field: str = opt("prompt", "hf: the column holding the prompt text")
    answer_field: str = opt("answer", "hf: the column holding the reference answer")
    messages_field: str = opt("", "hf: a column of chat messages ([{role, content}, ...]) "
                              "used as the prompt instead of prompt_field")
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
    type: str = opt("match", "how completions are scored (judge: an LLM behind an "
                    "OpenAI-compatible URL, set in [reward.judge])",
                    choices=("match", "math", "format", "custom", "judge"))
    pattern: str = opt("", "format: a regex a completion must contain to score 1")
    function: str = opt("", "custom: 'module:function' or 'path/to/file.py:function'")
    timeout_s: float = opt(5.0, "per-completion limit; a slow or failing scorer gives 0",
                           lo=0, lo_open=True, hi=MAX_WAIT_S)
    params: dict = opt({}, "free-form keyword arguments passed to a custom reward", factory=True)
    overlong_buffer: int = opt(0, "DAPO overlong shaping: completions within this many tokens "
                               "of training.max_tokens lose reward linearly, up to "
                               "overlong_penalty at the limit (0 = off)", lo=0, hi=MAX_TOKENS)
    overlong_penalty: float = opt(1.0, "the reward a completion at training.max_tokens loses "
                                  "(with overlong_buffer)", lo=0, hi=1e6)
    judge: dict = opt({}, "judge: the [reward.judge] table (base_url, model, rubric, mode, "
                      "...; docs/judges.md)", factory=True)


ENVIRONMENT_KINDS = ("task", "python", "guess_number", "lookup", "reasoning_gym", "verifiers",
                     "textarena")


@dataclass
class EnvironmentConfig:
    kind: str = opt("task", "what the model is asked: task = [data] + [reward] (one turn); "
                    "python = your own Environment class; or an adapted library",
                    choices=ENVIRONMENT_KINDS)
    factory: str = opt("", "python: 'file.py:Class' or 'module:function' that builds one "
                       "episode's Environment from [environment.params]")
    task: str = opt("", "reasoning_gym: the task name (e.g. 'basic_arithmetic')")
    tasks: dict = opt({}, "reasoning_gym: a weighted mix instead of task, "
                      "e.g. {basic_arithmetic = 2, chain_sum = 1}", factory=True)
    id: str = opt("", "verifiers: the installed environment module; textarena: the game id "
                  "(e.g. 'GuessTheNumber-v0')")
    params: dict = opt({}, "keyword arguments for the environment (python: the factory; "
                       "reasoning_gym: the task's config; verifiers: load_environment)",
                       factory=True)
    size: int = opt(5000, "reasoning_gym: training items generated (lazily, by index)", lo=1,
                    hi=MAX_PROBLEMS)
    max_turns: int = opt(0, "model turns per episode; 0 = 1 for task, 8 otherwise", lo=0,
                         hi=MAX_TURNS)
    max_episode_tokens: int = opt(0, "token budget of one episode (prompt, replies and "
                                  "environment messages); checked before each turn is sampled; "
                                  "0 = no limit beyond max_turns x training.max_tokens", lo=0,
                                  hi=MAX_TOKENS)
    on_length: str = opt("end", "a reply cut at training.max_tokens: end the episode once "
                         "the environment has scored it, or continue the episode",
                         choices=("end", "continue"))
    length_reward: float = opt(0.0, "reward added to an episode that ended on a cut reply "
                               "(on_length = 'end') or on max_episode_tokens")
    step_timeout_s: float = opt(30.0, "limit on one reset, step or tool call; a hung "
                                "environment is killed and its episode ends",
                                lo=0, lo_open=True, hi=MAX_WAIT_S)
    on_env_error: str = opt("zero_reward", "an environment that raises or hangs: its episode "
                            "ends with reward 0 (zero_reward), or its whole group is left out "
                            "of training (drop_group)", choices=("zero_reward", "drop_group"))
    tools: list[str] = opt([], "tools the model may call: built-in names ('calculator') or "
                           "'file.py:function' / 'module:function'", factory=True)
    tool_max_chars: int = opt(2000, "a tool's output is cut to this many characters", lo=1,
                              hi=MAX_TOKENS)
    binary: bool = opt(False, "reasoning_gym: reward 1 only for a fully correct answer "
                       "(no partial credit)")
    format_reward: float = opt(0.0, "reasoning_gym: reward added to a reply that answers "
                               "inside the answer tags, right or wrong (shaping for "
                               "small models; success still counts only correct answers)",
                               lo=0, hi=1)
    examples: int = opt(0, "reasoning_gym: solved items of the same task shown before the "
                        "question as earlier user/assistant turns (a few-shot prompt)", lo=0,
                        hi=MAX_TURNS)


@dataclass
class AlgorithmConfig:
    advantage: str = opt("grpo", "group advantage estimator",
                         choices=("grpo", "dr_grpo", "rloo", "maxrl", "reinforce_pp"))
    std_scale: str = opt("group", "grpo: divide by the std of the group, the batch, or not at all",
                         choices=("group", "batch", "none"))
    loss: str = opt("importance_sampling", "policy loss, as Tinker defines each (see "
                    "docs/algorithms.md); stable_reinforce and custom are Tinker names retrain "
                    "cannot compute", choices=TINKER_LOSS_FN_TYPES)
    loss_aggregation: str = opt("token_mean", "how the step's token losses are normalised: "
                                "token_mean (over all tokens), sequence_mean (mean of each "
                                "sequence's mean), constant (/ training.max_tokens x sequences, "
                                "Dr. GRPO)", choices=AGGREGATIONS)
    clip_eps: float | str = opt("auto", "ppo, cispo, gspo: the ratio's lower clip, ratio >= "
                                "1 - clip_eps; auto = the loss's default (0.2; cispo 1 = none)",
                                lo=0, hi=1, words=("auto",))
    clip_eps_high: float | str = opt("auto", "ppo, cispo, gspo: the ratio's upper clip, ratio <= "
                                     "1 + clip_eps_high; auto = the loss's default (0.2; cispo "
                                     "3)", lo=0, hi=100, words=("auto",))
    clip_ratio_c: float = opt(0.0, "ppo: dual clip, a negative-advantage token loses at most "
                              "clip_ratio_c x |advantage| (> 1, e.g. 3; 0 = off; local backend)",
                              lo=0, hi=100)
    dro_beta: float = opt(DEFAULT_DRO_BETA, "dro: weight of the penalty beta / 2 x (log p - "
                          "log q)^2 (Tinker's loss_fn_config beta)", lo=0, hi=1000)
    kl_coef: float = opt(0.0, "weight of the KL to the base model (the adapter disabled); "
                         "0 = no KL term", lo=0, hi=1e3)
    kl_estimator: str = opt("k1", "KL estimate per sampled token: k1 = log(p / p_base), k3 = "
                            "p_base / p - 1 - log(p_base / p) (never negative, lower variance)",
                            choices=("k1", "k3"))
    kl_in: str = opt("reward", "reward: kl_coef x the completion's KL is subtracted from its "
                     "reward before the advantages; loss: kl_coef x the per-token KL is added "
                     "to the loss (local backend)", choices=("reward", "loss"))


@dataclass
class TrainingConfig:
    seed: int = opt(42, "seed for data order, sampling and LoRA init", lo=0)
    batch_size: int = opt(8, "prompts per step", lo=1, hi=MAX_BATCH)
    group_size: int = opt(16, "completions per prompt", lo=1, hi=MAX_GROUP)
    max_tokens: int = opt(10240, "upper bound on new tokens per completion", lo=1,
                          hi=MAX_TOKENS)
    max_steps: int = opt(100, "RL steps per run (after the [sft] steps, if any; 0 = an SFT "
                         "run)", lo=0, hi=MAX_STEPS)
    lr: float = opt(5e-5, "AdamW learning rate (AdamW moves every weight by about lr per "
                    "step: above 1 it diverges)", lo=0, hi=1, lo_open=True)
    beta1: float = opt(0.9, "AdamW beta1", lo=0, hi=0.999999)
    beta2: float = opt(0.95, "AdamW beta2", lo=0, hi=0.999999)
    adam_eps: float = opt(1e-8, "AdamW epsilon", lo=0, lo_open=True)
    weight_decay: float = opt(0.0, "AdamW decoupled weight decay (lr x weight_decay must stay "
                              "below 1)", lo=0)
    grad_clip_norm: float = opt(1.0, "clip the gradient norm to this (0 = off)", lo=0)
    temperature: float = opt(1.0, "sampling temperature (also used for the trainer's log-probs); "
                             "at least 0.01: below, sampling is greedy in all but name",
                             lo=0.01)
    top_p: float = opt(1.0, "nucleus sampling; < 1 biases the importance ratio (docs/training.md)",
                       lo=0, hi=1, lo_open=True)
    stop: list[str] = opt([], "stop strings: a completion ends with the token that completes "
                          "one (the text stays in it, as tinker's SamplingParams.stop); "
                          "also in the held-out eval", factory=True)
    micro_batch_size: int = opt(0, "sequences per forward/backward chunk (0 = automatic)", lo=0,
                                hi=MAX_COMPLETIONS)
    save_every: int = opt(10, "checkpoint every N steps (and always at the end; 0 = end only)",
                          lo=0, hi=MAX_STEPS)
    eval_every: int = opt(0, "greedy eval on the held-out split every N steps (0 = start and end)",
                          lo=0, hi=MAX_STEPS)
    eval_samples: int = opt(1, "> 1: each eval also samples this many completions per held-out "
                            "problem: eval_mean_at_k, eval_pass_at_k, eval_mean_at_k_se", lo=1,
                            hi=MAX_GROUP)
    eval_temperature: float | str = opt("auto", "eval_samples > 1: their temperature (auto = "
                                        "training.temperature)", lo=0.01, words=("auto",))
    max_nonfinite_steps: int = opt(3, "stop the run after this many steps in a row whose loss "
                                   "or gradient norm was not finite (such steps are never "
                                   "applied)", lo=1, hi=MAX_STEPS)
    max_steps_off_policy: int = opt(
        0, "tinker: 1 = sample the next step while this one trains (samples one update old); "
        "0 = on-policy", lo=0, hi=1)
    mini_batches: int = opt(1, "split each step's groups into this many mini-batches, one "
                            "optimizer step each (the ratio stays against the sampler's "
                            "log-probs)", lo=1, hi=MAX_BATCH)
    epochs: int = opt(1, "passes over a step's mini-batches (updates per step = mini_batches "
                      "x epochs)", lo=1, hi=MAX_UPDATES)
    lr_schedule: str = opt("constant", "learning rate over the run after the warm-up: "
                           "constant, or linear / cosine decay from lr toward lr x min_lr_ratio, "
                           "reached one step after max_steps (no step trains at lr 0)",
                           choices=("constant", "linear", "cosine"))
    warmup_steps: int = opt(0, "steps of linear warm-up from lr / warmup_steps to lr", lo=0,
                            hi=MAX_STEPS)
    min_lr_ratio: float = opt(0.0, "linear / cosine: the rate the decay ends at, one step "
                              "after max_steps, as a fraction of lr", lo=0, hi=1)
    refill: bool = opt(False, "dynamic sampling: drop groups whose rewards are all equal and "
                       "sample more prompts until batch_size groups carry signal")
    max_refill_rounds: int = opt(4, "refill: extra sampling rounds a step may take", lo=1,
                                 hi=MAX_UPDATES)
    budget_usd: float = opt(0.0, "stop at the step where the run's cost ([cost]) reaches "
                            "this many US dollars (resumable; 0 = none)", lo=0)
    budget_tokens: int = opt(0, "stop at the step where its prefill + sampled + trained "
                             "tokens reach this (resumable; 0 = none)", lo=0)


@dataclass
class BackendConfig:
    """`slot_count` and `auto_concurrency` say what max_concurrent means for the campaign."""

    backend: str = opt("local", "where sampling and training run", choices=("local", "tinker"))
    max_concurrent: int | str = opt(
        4, "campaign-wide cap on concurrent remote API calls; \"auto\" = one controller per "
        "campaign fits the endpoint's USL curve and sets the cap (429/5xx cut it at once)",
        lo=1, hi=MAX_WORKERS, words=("auto",))
    max_concurrent_min: int = opt(1, "auto: the lowest cap the controller may set", lo=1,
                                  hi=MAX_WORKERS)
    max_concurrent_max: int = opt(64, "auto: the highest cap the controller may set", lo=1,
                                  hi=MAX_WORKERS)
    base_url: str = opt("", "tinker: service URL (default: $TINKER_BASE_URL or the SDK's)")
    request_timeout_s: float = opt(600.0, "tinker: deadline for one API call", lo=0, lo_open=True,
                                   hi=MAX_WAIT_S)
    compile: bool | str = opt(
        "auto", "local: torch.compile the sampler's decoding step (minutes of compiling per "
        "run; eager if the compile fails); \"auto\" = off: it was no faster on the CPUs "
        "measured (bench/RESULTS.md)", words=("auto",))
    sampler: str = opt(
        "auto", "local: exact = the step-by-step sampler through the trainer's adapter "
        "modules; fast = static KV cache, LoRA merged into fixed buffers, CUDA graphs, "
        "counter-based draws (other draws than exact for a seed; Llama, Qwen2 and Qwen3 "
        "models); auto = exact on CPU and MPS, fast on CUDA where the model's family allows "
        "(docs/gpu.md)",
        choices=("auto", "exact", "fast"))
    fast_ratio_cap: float = opt(
        2.0, "local, sampler fast: truncated importance sampling, a token's ratio p_trainer / "
        "p_sampler counts at most this much (the fast sampler's log-probs differ from the "
        "trainer's a little; as TRL's and SkyRL's caps); 0 = off", lo=0)
    options: dict = opt({}, "free-form backend options", factory=True)

    @property
    def auto_concurrency(self) -> bool:
        return self.max_concurrent == "auto"

    @property
    def slot_count(self) -> int:
        """How many slots the campaign's semaphore has: the fixed cap, or the auto ceiling."""
        return self.max_concurrent_max if self.auto_concurrency else int(self.max_concurrent)


@dataclass
class BackpressureConfig:
    enabled: bool = opt(False, "let the USL controller pick the batch size")
    warmup_steps: int = opt(10, "steps to collect before fitting (at least two per doubling size)",
                            lo=0, hi=MAX_STEPS)
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
class LoggingConfig:
    log_dir: str = opt("logs", "where runs and campaigns write, relative to the working folder")
    run_name: str = opt("", "run folder name inside log_dir, a plain name (default: the TOML "
                        "file's stem)")
    wandb_project: str = opt("", "log to Weights & Biases under this project (needs wandb)")
    tensorboard: bool = opt(False, "also write TensorBoard event files (needs tensorboard)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    backpressure: BackpressureConfig = field(default_factory=BackpressureConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


SECTIONS: dict[str, type] = dict(typing.get_type_hints(Config))


def section_fields(section: str) -> dict[str, dataclasses.Field]:
    """The fields of one section, by key."""
    return fields_of(SECTIONS[section])


def field_type(section: str, key: str) -> Any:
    """The annotated type of `section.key` (list[str], int, dict, ...)."""
    return hints_of(SECTIONS[section])[key]


def check_value(section: str, key: str, value: Any) -> tuple[Any, str | None]:
    """Coerce `value` to the field's type and check its range; return (value, problem)."""
    return check_field(SECTIONS[section], key, value)


# ---------------------------------------------------------------------------- building


def from_dict(raw: dict, source: str = "<config>") -> Config:
    """Validate a raw TOML-shaped dict of run sections into a Config, or raise ConfigError
    with every issue (`config_file.parse` reads a whole file, [campaign] included)."""
    issues: list[ConfigIssue] = []
    cfg = Config()
    for name, body in raw.items():
        problem = section_problem(SECTIONS, name, body)
        if problem:
            issues.append(problem)
        else:
            set_section(cfg, name, body, issues)
    issues += cross_checks(cfg)
    issues += table_checks(cfg, issues)
    if issues:
        raise ConfigError(source, issues)
    return cfg


def set_section(cfg: Config, name: str, body: dict, issues: list[ConfigIssue],
                hints: Mapping[str, type] = SECTIONS) -> None:
    """Check and store every key of run section [name]; an unknown key's did-you-mean may
    point to any of `hints` (a file's sections)."""
    section = getattr(cfg, name)
    fields = section_fields(name)
    for key, value in body.items():
        if key in fields:
            set_field(section, name, key, value, issues)
        else:
            issues.append(unknown_key(hints, name, key))


# ---------------------------------------------------------------------------- dumping


def to_dict(cfg: Config) -> dict:
    """The full run config as a TOML-shaped dict (every key, defaults included)."""
    return {name: copy.deepcopy(dataclasses.asdict(getattr(cfg, name))) for name in SECTIONS}


def run_config(cfg: Config, **changes: Any) -> Config:
    """A copy of `cfg` with dotted-key changes applied and re-validated."""
    raw = apply_overrides(to_dict(cfg), changes)
    return from_dict(raw, "<run config>")

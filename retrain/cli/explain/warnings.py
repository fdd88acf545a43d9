"""The dry run's warnings: settings that are legal but likely to hurt (sizes, files the config
names, missing packages or keys, campaigns whose conditions stop being comparable). Each says
what is wrong and what to do instead."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Any

from retrain.algorithms.schedule import warmup_problem
from retrain.campaign.plan import CampaignPlan
from retrain.cli.explain.memory import finetune_warnings
from retrain.config import toml_io
from retrain.config.sections import Config
from retrain.environments.kinds import default_max_turns


def warnings(cfg: Config, camp: CampaignPlan, path: Path, runs: int, parallelism: int,
             overrides: dict[str, Any], sft_steps: int = 0) -> list[str]:
    """Settings that are legal but likely to hurt: each says what and what to do instead.
    `sft_steps`: the [sft] stage's steps before the RL ones (an SFT run has no RL steps, and
    nothing is said of the settings only RL steps use)."""
    out: list[str] = []
    t, local = cfg.training, cfg.backend.backend == "local"
    if local and parallelism > 1:
        out.append(f"{parallelism} local runs at once share this machine's "
                   f"{_device_word(cfg)} and memory; each gets a fraction of it. Consider "
                   "campaign.parallel = false, a smaller campaign.max_workers, or "
                   "backend.backend = 'tinker'")
    if t.max_steps:
        out += _rl_warnings(cfg, path, parallelism, camp)
    if t.save_every and t.save_every > sft_steps + t.max_steps:
        steps = f"{sft_steps} [sft] steps + " if sft_steps else ""
        out.append(f"training.save_every ({t.save_every}) > the run's {steps}"
                   f"training.max_steps ({t.max_steps}): only the final checkpoint is saved")
    out += _backend_warnings(cfg)
    out += finetune_warnings(cfg)
    out += _campaign_warnings(cfg, camp, runs, overrides)
    return out


def _rl_warnings(cfg: Config, path: Path, parallelism: int, camp: CampaignPlan) -> list[str]:
    """The settings only RL steps use: sampling, scoring, the controller, the schedule."""
    out: list[str] = []
    t, bp, local = cfg.training, cfg.backpressure, cfg.backend.backend == "local"
    if local and _runs_on_cpu(cfg) and t.max_tokens > 2048:
        out.append(f"training.max_tokens = {t.max_tokens} on a CPU: a completion that runs to "
                   "the limit takes minutes; the smoke profile uses 1024")
    if bp.enabled and bp.max_batch_size < t.batch_size:
        out.append(f"backpressure.max_batch_size ({bp.max_batch_size}) < training.batch_size "
                   f"({t.batch_size}): the controller will never run the configured batch size")
    if bp.enabled and bp.min_batch_size > t.batch_size:
        out.append(f"backpressure.min_batch_size ({bp.min_batch_size}) > training.batch_size "
                   f"({t.batch_size}): the controller starts above the configured batch size")
    if t.group_size == 1:
        out.append("training.group_size = 1: every group advantage is 0, so nothing is learned; "
                   "use 2 or more")
    if t.lr > LARGE_LR:
        out.append(f"training.lr = {t.lr:g} is far above the usual LoRA range (1e-5 to 1e-3): "
                   "AdamW moves every weight by about lr per step, so the weights are likely "
                   "to diverge (the run then stops with 'weights diverged')")
    if t.top_p < 1:
        out.append(f"training.top_p = {t.top_p}: sampling from a truncated distribution biases "
                   "the importance ratio; keep 1.0 unless you know you need it")
    out += _size_warnings(cfg)
    out += _environment_warnings(cfg)
    if warmup := warmup_problem(t.max_steps, t.warmup_steps, t.lr_schedule):
        out.append(warmup)
    out += _roofline_hints(cfg)
    out += _file_warnings(cfg, path)
    out += _shared_api_backpressure(cfg, camp, parallelism)
    return out


LARGE_LR = 0.01                    # AdamW steps this large blow LoRA weights up
# Beyond these a configuration is legal but almost surely a typo or a memory problem.
LARGE_STEP_TOKENS = 50_000_000     # tokens one step may sample
LARGE_PROBLEMS = 1_000_000         # generated problems held in memory


def _size_warnings(cfg: Config) -> list[str]:
    """Sizes within the hard bounds (config.MAX_*) that are still likely mistakes."""
    out = []
    t, d = cfg.training, cfg.data
    tokens = t.batch_size * t.group_size * t.max_tokens
    if tokens > LARGE_STEP_TOKENS:
        out.append(f"one step may sample {t.batch_size} x {t.group_size} x {t.max_tokens} = "
                   f"{tokens:,} tokens (batch_size x group_size x max_tokens): expect very "
                   "long steps and large memory use; lower one of them")
    if d.source != "jsonl" and d.size + d.eval_size > LARGE_PROBLEMS:
        out.append(f"data.size + data.eval_size = {d.size + d.eval_size:,} generated problems "
                   "are held in memory; a few thousand are usually plenty")
    return out


def _environment_warnings(cfg: Config) -> list[str]:
    env, max_tokens = cfg.environment, cfg.training.max_tokens
    turns = default_max_turns(env)
    if env.max_episode_tokens and turns * max_tokens > env.max_episode_tokens:
        return [f"environment.max_turns ({turns}) x training.max_tokens ({max_tokens}) = "
                f"{turns * max_tokens} > environment.max_episode_tokens "
                f"({env.max_episode_tokens}): long episodes end on the budget (counted in "
                "'truncated') before their last turns; raise the budget or lower the others"]
    return []


def _device_word(cfg: Config) -> str:
    return "CPU" if _runs_on_cpu(cfg) else "GPU"


def _runs_on_cpu(cfg: Config) -> bool:
    """Best guess without importing torch: no NVIDIA driver and not a Mac means CPU."""
    if cfg.model.device != "auto":
        return cfg.model.device == "cpu"
    return not (Path("/proc/driver/nvidia").exists() or sys.platform == "darwin")


def _roofline_hints(cfg: Config) -> list[str]:
    """Back-pressure on this CPU without the roofline hints: offer the measured peaks."""
    from retrain.machine.cpu import auto_threads, cpu_has_native_bf16
    from retrain.machine.peaks import load_peaks

    bp = cfg.backpressure
    if not (bp.enabled and cfg.backend.backend == "local" and _runs_on_cpu(cfg)) or (
            bp.peak_gflops > 0 and bp.peak_bw_gb_s > 0):
        return []
    dtype = cfg.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    threads = cfg.model.threads or auto_threads()
    head = ("backpressure.peak_gflops and peak_bw_gb_s are not both set, so the controller "
            "cannot place steps on the roofline")
    peaks = load_peaks(dtype, threads)
    if peaks is None:
        return [f"{head}; measure this machine with `python -m retrain.machine --dtype {dtype} "
                f"--threads {threads}` and set them"]
    return [f"{head}; this machine measured {peaks.gflops:.0f} GFLOP/s ({dtype} matmul, "
            f"{threads} threads) and {peaks.bw_gb_s:.0f} GB/s on {peaks.measured}: set "
            f"peak_gflops = {peaks.gflops:.0f} and peak_bw_gb_s = {peaks.bw_gb_s:.0f}"]


def _backend_warnings(cfg: Config) -> list[str]:
    out = []
    b = cfg.backend
    loopback = any(h in b.base_url for h in ("127.0.0.1", "localhost", "[::1]"))
    if b.backend == "tinker" and not loopback and not os.environ.get("TINKER_API_KEY"):
        out.append("backend.backend = 'tinker' needs TINKER_API_KEY in the environment "
                   "(it is not set)")
    if b.backend == "tinker" and importlib.util.find_spec("tinker") is None:
        out.append("backend.backend = 'tinker' needs the tinker SDK: pip install 'retrain[tinker]'")
    trackers = (("logging.wandb_project", cfg.logging.wandb_project, "wandb"),
                ("logging.tensorboard", cfg.logging.tensorboard, "tensorboard"))
    for key, value, module in trackers:
        if value and importlib.util.find_spec(module) is None:
            out.append(f"{key} is set but {module} is not installed: pip install {module}")
    return out


def _file_warnings(cfg: Config, path: Path) -> list[str]:
    """Files the config names, resolved against the config file's folder."""
    out = []
    here = path.parent
    if cfg.data.path and cfg.data.source != "jsonl":
        out.append(f"data.path is ignored because data.source = '{cfg.data.source}' "
                   "(set data.source = 'jsonl' to use it)")
    if cfg.data.source != "jsonl" and cfg.data.eval_size >= cfg.data.size:
        out.append(f"data.eval_size ({cfg.data.eval_size}) >= data.size ({cfg.data.size}): "
                   "no problems are left to train on")
    fn = cfg.reward.function
    if cfg.reward.type == "custom" and ".py:" in fn:
        file = here / fn.rsplit(":", 1)[0]
        if not file.is_file():
            out.append(f"reward.function = '{fn}': no such file (looked for {file})")
    return out


def _anywhere(cfg_value: Any, c: CampaignPlan, key: str, wanted: Any) -> bool:
    """Whether `key` is `wanted` in the base config, a condition or the grid."""
    values = [cfg_value] + [cond.overrides.get(key) for cond in c.conditions]
    grid_values = c.grid.get(key, [])
    values += grid_values if isinstance(grid_values, list) else [grid_values]
    return any(v == wanted and type(v) is type(wanted) for v in values)


def _shared_api_backpressure(cfg: Config, c: CampaignPlan, parallelism: int) -> list[str]:
    """Runs of one parallel campaign, each with its own back-pressure controller, over one
    remote API: every controller reads the others' load as its own contention."""
    if not c.is_campaign or parallelism < 2:
        return []
    if not _anywhere(cfg.backpressure.enabled, c, "backpressure.enabled", True) or \
            not _anywhere(cfg.backend.backend, c, "backend.backend", "tinker"):
        return []
    return [f"backpressure.enabled in {parallelism} runs at once over one shared API: each "
            "run's controller reads the others' load as its own contention, so they fight "
            "(measured: four runs settled at four different batch sizes and reached their "
            "reward later). Set backpressure.enabled = false and backend.max_concurrent = "
            "\"auto\": one controller per campaign tunes the API calls in flight without "
            "changing any run's batch"]


def bp_on_in_conditions(cfg: Config, c: CampaignPlan) -> bool:
    """Back-pressure on (anywhere) in a campaign with several conditions or grid points."""
    grid_points = math.prod(len(v) if isinstance(v, list) else 1 for v in c.grid.values())
    if len(c.conditions) < 2 and not (c.grid and grid_points >= 2):
        return False
    values = [cfg.backpressure.enabled]
    values += [cond.overrides.get("backpressure.enabled") for cond in c.conditions]
    grid_values = c.grid.get("backpressure.enabled", [])
    values += grid_values if isinstance(grid_values, list) else [grid_values]
    return any(v is True for v in values)


def _scheduling_without_runs(c: CampaignPlan) -> list[str]:
    """[campaign] parallel / max_workers / stagger_seconds set, but nothing to expand."""
    defaults = CampaignPlan()
    changed = [k for k in ("parallel", "max_workers", "stagger_seconds")
               if getattr(c, k) != getattr(defaults, k)]
    if not changed or c.is_campaign:
        return []
    keys = ", ".join(f"campaign.{k}" for k in changed)
    return [f"{keys} set without campaign.seeds, conditions or grid: this is a single run and "
            "they have no effect; add e.g. seeds = [1, 2, 3] to make it a campaign"]


def _campaign_warnings(cfg: Config, c: CampaignPlan, runs: int,
                       overrides: dict[str, Any]) -> list[str]:
    out = _scheduling_without_runs(c)
    if not c.is_campaign:
        return out
    if c.seeds and "training.seed" in overrides:
        out.append("--seed / training.seed has no effect here: campaign.seeds sets each run's "
                   "seed")
    seen: dict[str, str] = {}
    for cond in c.conditions:
        key = toml_io.format_value(dict(sorted(cond.overrides.items())))
        if key in seen:
            out.append(f"conditions '{seen[key]}' and '{cond.name}' set the same overrides: "
                       "their runs differ only by name")
        seen.setdefault(key, cond.name)
    if bp_on_in_conditions(cfg, c):
        out.append("backpressure.enabled with several conditions: each run picks its own batch "
                   "sizes, so the conditions differ by more than their overrides and stop being "
                   "comparable; set backpressure.enabled = false or a fixed batch per condition")
    if c.parallel and c.max_workers > runs > 0:
        out.append(f"campaign.max_workers ({c.max_workers}) > runs ({runs}): only {runs} "
                   "workers will start")
    return out

"""`retrain explain FILE`: a dry run. Load and validate the config, then say what would run,
how much work it is and how long it may take, and which settings look risky.

The wall-time estimate uses the median `step_time_s` of the most recent earlier run under
`log_dir` with the same capacity settings (model, backend, device, task, batch_size,
group_size, max_tokens, and the same back-pressure setting: with it on, the same batch-size
bounds and objective instead of batch_size, and only the steps after the pilot's warm-up at
the batch size it settled on): a pilot. Without one the estimate is "unknown: run a pilot".
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from retrain.algorithms import losses
from retrain.campaign.plan import CampaignPlan
from retrain.cli import render
from retrain.cli.explain.cost import CostEstimate, cost_estimate
from retrain.cli.explain.data import DataReader
from retrain.cli.explain.distributed import distributed_line
from retrain.cli.explain.memory import memory_line, model_family
from retrain.cli.explain.race import race_settings
from retrain.cli.explain.warnings import warnings
from retrain.config import loader as config_file
from retrain.config import sections as config
from retrain.config import toml_io
from retrain.config.judge_section import judge_config
from retrain.config.sections import Config
from retrain.control import capacity
from retrain.environments.kinds import default_max_turns, episode_token_bound
from retrain.runfiles import runlog

UNKNOWN_TIME = "unknown: run a pilot"


@dataclass
class RunPlan:
    """One run the config would start."""

    name: str
    folder: str
    condition: str = ""
    seed: int = 0
    overrides: dict = field(default_factory=dict)
    max_steps: int = 0
    completions_per_step: int = 0
    sft_steps: int = 0             # the [sft] stage's steps before the RL ones


@dataclass
class Pilot:
    """The earlier run whose step times the estimate uses."""

    run: str
    median_step_time_s: float
    steps: int


@dataclass
class Report:
    config_file: str
    kind: str                      # "single run" or "campaign"
    name: str                      # run name, or campaign folder name
    settings: dict[str, Any]
    completions_per_step: int
    runs: list[RunPlan]
    conditions: list[str]
    seeds: list[int]
    total_steps: int
    effective_parallelism: int
    pilot: Pilot | None
    wall_time_s: float | None
    wall_time: str                 # human-readable, or UNKNOWN_TIME
    warnings: list[str]
    executor: str = "local"        # campaigns: [campaign] executor
    cluster: str = ""              # executor = "ray": the cluster's resources, when reachable
    runs_at_once: int | None = None  # executor = "ray": runs the cluster fits at once (capped)
    machine: str = ""              # local runs: this machine's load now, when it is busy
    sft: str = ""                  # the [sft] stage: its data, conversations and steps
    data: str = ""                 # [data]: where, training problems, held out (RL steps)
    cost: CostEstimate | None = None  # tokens and money: the bound, and a pilot's expected


# ---------------------------------------------------------------------------- building


def build_report(path: str | Path, overrides: dict[str, Any] | None = None) -> Report:
    """Load `path` (with command-line overrides) and plan it; raises ConfigError on bad input."""
    overrides = overrides or {}
    cfg, camp = config_file.read_file(path, overrides)  # camp: [campaign], even if idle
    path = Path(path)
    log_dir = Path(cfg.logging.log_dir)
    reader = DataReader(path.parent)  # every data source the runs read, read as they will
    if camp.is_campaign:
        folder = campaign_folder(camp, cfg, path)
        name = folder.name
        plans, run_cfgs = _campaign_plans(cfg, camp, folder, reader)
    else:
        name = cfg.logging.run_name or path.stem
        plans = [_plan(name, str(log_dir / name), cfg, reader)]
        run_cfgs = [cfg]
    data = reader.read(cfg)
    steps = capacity.total_steps(p.sft_steps + p.max_steps for p in plans)
    par = capacity.effective_parallelism(camp.parallel if camp.is_campaign else False,
                                         camp.max_workers, len(plans))
    pilot = find_pilot(log_dir, {signature(c) for c in run_cfgs})
    wall = capacity.wall_time_s(pilot.median_step_time_s, steps, par) if pilot else None
    cluster, fits = "", None
    if camp.is_campaign and camp.executor == "ray":
        from retrain.campaign.ray_executor import describe_cluster  # imports Ray only here

        cluster, fits = describe_cluster(cfg, camp, folder)
        fits = min(fits, par) if fits is not None else None
    settings = key_settings(cfg, camp) | race_settings(path, camp, plans, run_cfgs)
    if cfg.backend.backend == "local":  # a campaign's line: its first full run's, if any
        shown = next((c for c in run_cfgs if c.model.finetune == "full"), run_cfgs[0])
        settings["memory"] = memory_line(shown, path.parent)
        if ranks_line := distributed_line(run_cfgs[0], path.parent):
            settings["distributed"] = ranks_line
        settings["sampler"] = sampler_line(cfg.backend.sampler, cfg.model.device,
                                           *model_family(cfg.model.name, path.parent))
    return Report(
        config_file=str(path), kind="campaign" if camp.is_campaign else "single run", name=name,
        settings=settings,
        completions_per_step=capacity.completions_per_step(cfg.training.batch_size,
                                                           cfg.training.group_size),
        runs=plans, conditions=_unique(p.condition for p in plans if p.condition),
        seeds=_unique(p.seed for p in plans) if camp.is_campaign else [],
        total_steps=steps, effective_parallelism=par, pilot=pilot, wall_time_s=wall,
        wall_time=capacity.human_duration(wall) if wall is not None else UNKNOWN_TIME,
        warnings=warnings(cfg, camp, path, len(plans), par, overrides, data.sft_steps)
        + ([data.sft_warning] if data.sft_warning else []),
        executor=camp.executor, cluster=cluster, runs_at_once=fits, machine=_machine_note(cfg),
        sft=data.sft, data=data.task,
        cost=cost_estimate(path, cfg, camp, plans, run_cfgs, pilot and pilot.run))


def _machine_note(cfg: Config) -> str:
    """Say so when other work already competes for the cores a local run would use."""
    from retrain.machine.cpu import auto_threads, available_cores, busy_note, load_average

    if cfg.backend.backend != "local" or cfg.model.device not in ("auto", "cpu"):
        return ""
    note = busy_note(load_average(), available_cores(), cfg.model.threads or auto_threads())
    return note and (f"{note} before this run starts: steps will be slower than on a quiet "
                     "machine (docs/training.md, 'A busy machine')")


def campaign_folder(camp: CampaignPlan, cfg: Config, path: Path) -> Path:
    """The folder the campaign runner really writes to: the cleaned name (`../../x` -> `x`),
    the newest `<name>-<k>` it would resume, under log_dir (shown as given, normalised)."""
    from retrain.campaign.matrix import safe_name
    from retrain.campaign.runner import locate_campaign

    name = safe_name(camp.name or path.stem, "campaign")
    log_dir = Path(os.path.normpath(Path(cfg.logging.log_dir).expanduser()))
    return log_dir / locate_campaign(log_dir.resolve(), name, new=False).name


def _unique(items: Any) -> list:
    return list(dict.fromkeys(items))


def _plan(name: str, folder: str, cfg: Config, reader: DataReader, condition: str = "",
          overrides: dict | None = None) -> RunPlan:
    t = cfg.training
    return RunPlan(name=name, folder=folder, condition=condition, seed=t.seed,
                   overrides=dict(overrides or {}), max_steps=t.max_steps,
                   completions_per_step=capacity.completions_per_step(t.batch_size, t.group_size),
                   sft_steps=reader.read(cfg).sft_steps)


def _campaign_plans(cfg: Config, camp: CampaignPlan, folder: Path, reader: DataReader
                    ) -> tuple[list[RunPlan], list[Config]]:
    """Expand the matrix (retrain.campaign.matrix) into plans and per-run configs."""
    from retrain.campaign.matrix import expand, run_config_for

    plans, cfgs = [], []
    for spec in expand(cfg, camp):
        run_cfg = run_config_for(cfg, spec, folder)  # exactly what the runner will write
        plans.append(_plan(spec.name, str(folder / spec.name), run_cfg, reader, spec.condition,
                           spec.overrides))
        cfgs.append(run_cfg)
    return plans, cfgs


def key_settings(cfg: Config, camp: CampaignPlan) -> dict[str, Any]:
    """The settings a reader checks first, as dotted keys."""
    keys = ["model.name", "model.device", "backend.backend", "data.source", "reward.type",
            "algorithm.advantage", "algorithm.loss", "training.batch_size",
            "training.group_size", "training.max_tokens", "training.max_steps", "training.lr",
            "training.seed", "backpressure.enabled", "logging.log_dir", "environment.kind",
            "model.finetune"]
    if cfg.backend.backend == "tinker":
        keys += ["backend.max_concurrent", "backend.max_concurrent_min",
                 "backend.max_concurrent_max"]
    if cfg.backend.backend == "local":
        keys += ["backend.sampler"]
    settings = {k: _get(cfg, k) for k in keys}
    env = cfg.environment
    settings["environment.max_turns"] = default_max_turns(env)
    settings["environment.max_episode_tokens"] = env.max_episode_tokens
    settings["episode_tokens_worst_case"] = episode_token_bound(env, cfg.training.max_tokens)
    settings["algorithm.loss_aggregation"] = cfg.algorithm.loss_aggregation
    settings["loss"] = losses.describe(cfg.algorithm)
    if cfg.reward.type == "judge" and env.kind == "task":
        settings["judge"] = judge_line(cfg, camp.is_campaign)
    if camp.is_campaign:
        settings |= {f"campaign.{k}": getattr(camp, k)
                     for k in ("parallel", "max_workers", "stagger_seconds")}
    return settings


def judge_line(cfg: Config, campaign: bool) -> str:
    """The judge, its budget and the most requests one step may send (every retry taken)."""
    judge = judge_config(cfg.reward)
    per_try = cfg.training.batch_size * (1 if judge.mode == "group" else cfg.training.group_size)
    budget = "shared by the campaign's runs" if campaign else "per run"
    return (f"{judge.model} at {judge.base_url}, {judge.mode}; at most {judge.max_concurrent} "
            f"requests in flight ({budget}); per step {per_try} requests, "
            f"{per_try * (judge.retries + 1)} at worst with retries")


def _get(cfg: Config, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


# ---------------------------------------------------------------------------- pilot runs


def signature(cfg: Config) -> tuple:
    """The settings that decide how long a step takes; a pilot must share all of them.

    Back-pressure picks the batch size itself, so a run with it on is only compared with runs
    that had it on with the same bounds (its training.batch_size is then not the step's)."""
    base = (cfg.model.name, cfg.backend.backend, cfg.model.device, cfg.data.source,
            cfg.training.group_size, cfg.training.max_tokens)
    bp = cfg.backpressure
    if bp.enabled:
        return (*base, "backpressure", bp.min_batch_size, bp.max_batch_size, bp.objective)
    return (*base, "fixed batch", cfg.training.batch_size)


def pilot_step_times(rows: list[dict]) -> list[object]:
    """The step times a pilot lends: every step of a fixed-batch run; for a back-pressure run,
    the steps after its warm-up at the batch size it settled on (the last decision's)."""
    if not any("bp_regime" in r for r in rows):
        return [r.get("step_time_s") for r in rows]
    settled = [r for r in rows if r.get("bp_regime") not in (None, "warmup")]
    if not settled:
        return []
    last = settled[-1].get("batch_size")
    return [r.get("step_time_s") for r in settled if r.get("batch_size") == last]


def find_pilot(log_dir: Path, signatures: set[tuple]) -> Pilot | None:
    """The most recent run under `log_dir` whose resolved config matches one of `signatures`
    and which has logged step times."""
    if not log_dir.is_dir():
        return None
    runs, _ = runlog.walk_logs(log_dir)
    candidates = []
    for run in runs:
        metrics = run / runlog.METRICS_FILE
        if metrics.is_file() and _run_signature(run) in signatures:
            candidates.append((metrics.stat().st_mtime, run))
    for _, run in sorted(candidates, reverse=True):
        times = pilot_step_times(runlog.read_metrics(run / runlog.METRICS_FILE).rows)
        median = capacity.median_step_time(times)
        if median is not None:
            n = sum(1 for t in times if isinstance(t, (int, float)))
            return Pilot(run=str(run), median_step_time_s=median, steps=n)
    return None


def _run_signature(run: Path) -> tuple | None:
    try:
        raw = toml_io.loads((run / runlog.CONFIG_FILE).read_text(encoding="utf-8"))
        return signature(config_file.parse(raw, str(run))[0])
    except (OSError, UnicodeDecodeError, toml_io.TOMLDecodeError, config.ConfigError):
        return None


# ---------------------------------------------------------------------------- rendering


def show(report: Report, as_json: bool = False) -> None:
    """Print the report: JSON, rich on a terminal, or plain text."""
    if as_json:
        print(render.dump_json(asdict(report)))
    elif render.stdout_is_terminal():
        _render_rich(report)
    else:
        print("\n".join(plain_lines(report)))


def _summary_lines(r: Report) -> list[tuple[str, str]]:
    s = r.settings
    runs = len(r.runs)
    head = (f"campaign '{r.name}': {runs} runs"
            + (f" ({len(r.conditions)} conditions x {len(r.seeds)} seeds)"
               if r.conditions and len(r.conditions) * len(r.seeds) == runs else "")
            if r.kind == "campaign" else f"single run '{r.name}'")
    out = [("kind", head),
           ("model", f"{s['model.name']} on backend {s['backend.backend']} "
                     f"(device {s['model.device']})"),
           ("task", f"{s['data.source']}, reward {s['reward.type']}, advantage "
                    f"{s['algorithm.advantage']}, loss {s['algorithm.loss']}")
           if s["environment.kind"] == "task" else
           ("environment", f"{s['environment.kind']}, up to {s['environment.max_turns']} "
                           f"turns, at most {s['episode_tokens_worst_case']} sampled tokens per "
                           "episode" + (f" (budget {s['environment.max_episode_tokens']} "
                                        "tokens)" if s["environment.max_episode_tokens"]
                                        else "") + f"; advantage {s['algorithm.advantage']}, "
                           f"loss {s['algorithm.loss']}"),
           ("per step", f"{s['training.batch_size']} prompts x {s['training.group_size']} "
                        f"completions = {r.completions_per_step} completions, up to "
                        f"{s['training.max_tokens']} tokens each"
                        if s["environment.kind"] == "task" else
                        f"{s['training.batch_size']} groups x {s['training.group_size']} "
                        f"episodes = {r.completions_per_step} episodes, up to "
                        f"{s['training.max_tokens']} tokens per reply"),
           *([("data", r.data)] if r.data and s["environment.kind"] == "task" else []),
           ("loss", s["loss"]),
           *([("sft", r.sft)] if r.sft else []),
           ("training", f"{s['training.max_steps']} {'RL steps after them' if r.sft else 'steps'}"
                        f", lr {s['training.lr']}, seed {s['training.seed']}"),
           ("back-pressure", "on" if s["backpressure.enabled"] else "off")]
    if "backend.sampler" in s:
        out.append(("sampler", s.get("sampler") or sampler_line(s["backend.sampler"],
                                                                 s["model.device"])))
    out += [(k, s[k]) for k in ("memory", "distributed", "judge", "race") if k in s]
    if "backend.max_concurrent" in s:
        cap = s["backend.max_concurrent"]
        out.append(("API calls", f"at most {cap} in flight" if cap != "auto" else
                    f"auto: {s['backend.max_concurrent_min']} to "
                    f"{s['backend.max_concurrent_max']} in flight, set by the campaign's "
                    "controller (logs/<campaign>/concurrency.jsonl)"))
    if r.kind == "campaign":
        mode = (f"parallel, max_workers {s['campaign.max_workers']}, stagger "
                f"{s['campaign.stagger_seconds']}s" if s["campaign.parallel"] else "one at a time")
        out.append(("workers", mode))
        out.append(("executor", _executor_line(r)))
    out.append(("logs", r.runs[0].folder if r.kind == "single run"
                else str(Path(r.runs[0].folder).parent) if r.runs else s["logging.log_dir"]))
    out.append(("total steps", f"{r.total_steps}" + (f" ({runs} runs)" if runs > 1 else "")))
    out.append(("parallelism", str(r.effective_parallelism)))
    out.append(("wall time", _wall_line(r)))
    out += r.cost.lines if r.cost else []
    if r.machine:
        out.append(("machine", r.machine))
    if not s["training.max_steps"]:  # an SFT run: nothing is sampled, scored or RL-trained
        out = [(k, v) for k, v in out if k not in RL_ONLY]
    return out


RL_ONLY = ("task", "environment", "per step", "data", "loss", "sampler")


def sampler_line(setting: str, device: str, model_type: str | None = None,
                 layer_types: list[str] | None = None) -> str:
    """The local sampler a run gets and why: `auto` resolved for the device (a guess for
    device auto) and the model's family (`model_type`, None when not on this machine yet)."""
    from retrain.backends.sampler_mode import choose

    # device auto: cuda where an NVIDIA driver is loaded (as explain_warnings guesses)
    kind = device if device != "auto" else (
        "cuda" if Path("/proc/driver/nvidia").exists() else "cpu")
    choice = choose(setting, kind, model_type, layer_types)
    how = {"exact": "step by step through the adapter, torch.Generator draws",
           "fast": "static KV cache, merged LoRA, CUDA graphs on CUDA, counter draws"}
    unknown = ("; the model's family is checked when it loads"
               if model_type is None and choice.mode == "fast" else "")
    return f"{choice.mode} ({how[choice.mode]}): {choice.why}{unknown}"


def _executor_line(r: Report) -> str:
    if r.executor != "ray":
        return "local (processes on this machine)"
    if r.runs_at_once is None:
        return f"ray: {r.cluster}"
    return f"ray: {r.cluster}; {r.runs_at_once} run(s) fit at once"


def _wall_line(r: Report) -> str:
    if r.pilot is None:
        return (f"{UNKNOWN_TIME} (no earlier run under {r.settings['logging.log_dir']} with the "
                "same model, backend, device, task, batch_size, group_size and max_tokens)")
    p = r.pilot
    return (f"~{r.wall_time} = {p.median_step_time_s:.3g}s median step x {r.total_steps} steps"
            f" / {r.effective_parallelism} (from {p.run}, {p.steps} steps)")


def runs_table(r: Report) -> render.Table:
    varied = len({p.completions_per_step for p in r.runs}) > 1
    headers = ["run", "condition", "seed", "steps", "overrides"]
    if varied:
        headers.insert(4, "completions/step")
    rows = []
    for p in r.runs:
        over = ", ".join(f"{k}={toml_io.format_value(v)}" for k, v in p.overrides.items())
        row = [p.name, p.condition or "-", str(p.seed), str(p.sft_steps + p.max_steps),
               over or "-"]
        if varied:
            row.insert(4, str(p.completions_per_step))
        rows.append(row)
    return render.Table(headers, rows)


def plain_lines(r: Report) -> list[str]:
    """The report as plain text lines."""
    lines = [f"{r.config_file}: OK"]
    width = max(len(k) for k, _ in _summary_lines(r))
    lines += [f"  {k.ljust(width)}  {v}" for k, v in _summary_lines(r)]
    if r.kind == "campaign":
        lines += ["", "run matrix:", *render.plain_table(runs_table(r), indent="  ")]
    if r.warnings:
        lines += ["", f"warnings ({len(r.warnings)}):"] + [f"  - {w}" for w in r.warnings]
    return lines


def _render_rich(r: Report) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console()
    console.print(f"[bold]{escape(r.config_file)}[/]: [green]OK[/]")
    width = max(len(k) for k, _ in _summary_lines(r))
    for k, v in _summary_lines(r):
        console.print(f"  [bold]{k.ljust(width)}[/]  {escape(v)}", highlight=False)
    if r.kind == "campaign":
        console.print()
        console.print(render.rich_table(runs_table(r)))
    if r.warnings:
        console.print(f"\n[yellow bold]warnings ({len(r.warnings)}):[/]")
        for w in r.warnings:
            console.print(f"  [yellow]-[/] {escape(w)}", highlight=False)

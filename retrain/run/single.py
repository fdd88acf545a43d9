"""One run from its config: the run folder's lock and resume point, the stages built from the
config's sections (SFT data, task, scorer, backend, rollouts), the SFT stage when there is one
and its resume point is not past it, then the Trainer's RL steps; closed after."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from retrain.backends import create_backend
from retrain.config.cross_checks import run_name_problem
from retrain.config.sections import Config, DataConfig, run_config
from retrain.distributed.lead import lead
from retrain.environments.rollout import build_rollouts, uses_scorer
from retrain.environments.scorer import build_scorer
from retrain.environments.sft.data import SftData, load_sft, sft_steps
from retrain.environments.tasks import TaskSplits, data_path, load_task
from retrain.errors import UserError
from retrain.run import checkpoint, run_lock
from retrain.run.record import RunRecord
from retrain.run.rl_sections import RlSections
from retrain.run.run_facts import DataDigest, RunFacts, digest
from retrain.run.sft import SftStage, is_sft_point
from retrain.run.trainer import Trainer
from retrain.runfiles import runlog
from retrain.slots.file_slots import slots_from_env


def run_single(cfg: Config, config_path: Path, new: bool = False, group: Any = None) -> int:
    """Train (or resume) the run described by `cfg`; returns the process exit status.
    `group`: this process is rank 0 of a run on several ranks (retrain/distributed)."""
    config_path = Path(config_path)
    run_name = cfg.logging.run_name or config_path.stem
    if run_name_problem(run_name):  # a file named `..toml`: its stem names no folder
        raise UserError(f"{config_path}: logging.run_name (the file's stem by default): "
                        f"{run_name_problem(run_name)}")
    run_dir = Path(cfg.logging.log_dir) / run_name
    _refuse_a_campaign_folder(config_path, run_dir)
    with run_lock.hold(run_dir):  # a second process on this folder: one line, exit 2
        return _run_locked(cfg, config_path, run_dir, run_name, new, group)


def _refuse_a_campaign_folder(config_path: Path, run_dir: Path) -> None:
    """A campaign and a single run both default to the file's stem: a file whose [campaign]
    was removed would write into the campaign's folder, and its --new move the campaign."""
    if runlog.is_campaign_dir(run_dir):
        raise UserError(f"{config_path}: {run_dir} holds a campaign ({runlog.MANIFEST_FILE}), "
                        "and this file is a single run (no [campaign] seeds, conditions or "
                        "grid); nothing was changed. Set logging.run_name to another name (it "
                        "defaults to the file's stem), or restore [campaign] to go on with the "
                        "campaign")


def _run_locked(cfg: Config, config_path: Path, run_dir: Path, run_name: str,
                new: bool, group: Any) -> int:
    config_dir = config_path.resolve().parent
    needs_sft = cfg.sft.enabled and (new or not _past_sft(run_dir))
    sft = load_sft(cfg.sft, config_dir) if needs_sft else None
    rl = cfg.training.max_steps > 0  # 0: an SFT run, nothing of [data] or [reward] is used
    splits = load_task(cfg.data, cfg.training.seed, config_dir) if rl else TaskSplits([], [])
    digests = _digests(cfg.data, config_dir, sft, splits if rl else None)
    start = checkpoint.prepare(run_dir, cfg, new=new, digests=digests,
                               sft_steps=sft_steps(cfg.sft, sft.rows) if sft else 0)
    if start.moved_to is not None:
        print(f"--new: moved the previous run to {start.moved_to}")
    if start.note:
        print(f"{run_dir}: {start.note}")
    if start.finished:
        print(f"{run_dir} already finished {start.state.step} steps; nothing to do "
              "(raise training.max_steps to continue it, or use --new to start over)")
        return 0
    checkpoint.ensure_writable(run_dir)
    slots = slots_from_env()  # the campaign's API semaphore, or a no-op for a standalone run
    scorer = build_scorer(cfg.reward, config_dir, run_dir) \
        if rl and uses_scorer(cfg.environment) else None
    backend = lead(create_backend(cfg.model, cfg.training, cfg.backend, slots,
                                  keep_reference=cfg.algorithm.kl_coef > 0,
                                  config_dir=config_dir,
                                  checkpoint_dir=run_dir / runlog.CHECKPOINT_DIR), group)
    rollouts = None
    try:
        if rl:
            rollouts = build_rollouts(cfg.environment, cfg.data, cfg.reward, cfg.training.seed,
                                      config_dir, backend, scorer, splits.train)
        cfg = run_config(cfg, **{"logging.run_name": run_name})  # config.toml re-runnable
        record = RunRecord.of(cfg)
        points = [start.state, *start.fallbacks] if start.state else []
        facts = RunFacts(start.sft_steps, digests)
        rl_points, after = [p for p in points if not is_sft_point(p)], None
        if sft is not None and not rl_points:  # the SFT steps not done yet come first
            code, after = SftStage(cfg.sft, cfg.training, cfg.cost, record, sft, run_dir, backend,
                                   config_path, facts).run(points)
            if code or not rl:
                return code
        trainer = Trainer(RlSections.of(cfg), record, run_dir, splits, scorer, backend, slots,
                          config_path, rollouts, facts)
        return trainer.run(rl_points[0] if rl_points else None, rl_points[1:], after=after)
    finally:
        if rollouts is not None:
            rollouts.close()
        if scorer is not None:
            scorer.close()
        backend.close()


def _past_sft(run_dir: Path) -> bool:
    """Whether the run's newest resume point is an RL step's (with the SFT step count fixed at
    its start): its SFT stage is over, so [sft.data] is neither read nor checked again (the
    file may be gone). A resume inside the stage still reads and checks it."""
    points = checkpoint.resume_points(run_dir, runlog.read_state(run_dir).state)
    return bool(points) and not is_sft_point(points[0]) \
        and checkpoint.fixed_sft_steps(points[0], -1) >= 0


def _digests(data: DataConfig, config_dir: Path, sft: SftData | None,
             splits: TaskSplits | None) -> list[DataDigest]:
    """The content digests of the data this launch reads (run/data_digest.py)."""
    found = [digest("sft.data", sft.where, sft.conversations)] if sft is not None else []
    if splits is not None:
        local = data.source == "jsonl" or (data.source == "hf"
                                           and data_path(data, config_dir).exists())
        where = str(data_path(data, config_dir)) if local else \
            data.path if data.source == "hf" else f"the built-in {data.source} task"
        found.append(digest("data", where, [*splits.train, *splits.eval]))
    return found

"""Which checkpoint of a run the results commands use, and the run's own config.

A run folder holds `config.toml` (the resolved config, file references absolute) and one
resume point per kept checkpoint (`checkpoints/step-N.json`, naming the checkpoint: a folder
relative to the run folder or a `tinker://` path); `state.json` names the newest. A run folder
only ever uses its own checkpoints (runlog.own_checkpoint). Read through runlog/safejson.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from retrain.config.sections import Config, ConfigError
from retrain.errors import UserError
from retrain.runfiles import runlog

TINKER_SCHEME = runlog.TINKER_SCHEME
POINT_SUFFIX = ".json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILES = ("adapter_model.safetensors", ADAPTER_CONFIG)  # what loading an adapter reads
MODEL_CONFIG = "config.json"  # a full fine-tuning checkpoint is a whole transformers model
MODEL_FILES = ("model.safetensors", MODEL_CONFIG)
OPTIONAL_FILES = ("generation_config.json",)
PICKS = 5     # a run still training prunes; 5 picks in a row outrun its commits
GONE_S = 0.2  # how long a folder being pruned may still exist without its files


@dataclass(frozen=True)
class Checkpoint:
    """One saved step: its number and where its weights are (a folder or a tinker:// path)."""

    step: int
    ref: str
    copy: Path | None = None  # the weight files copied aside by `held`, loaded from there

    @property
    def is_tinker(self) -> bool:
        return self.ref.startswith(TINKER_SCHEME)

    @property
    def folder(self) -> Path:
        return self.copy or Path(self.ref)


def check_run_dir(run_dir: Path) -> Path:
    """`run_dir` as a Path; UserError when it is no run folder."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run folder (give a folder like logs/<run>)")
    if not (run_dir / runlog.CONFIG_FILE).is_file():
        hint = " (a campaign folder: give one of its runs, logs/<campaign>/<run>)" \
            if runlog.is_campaign_dir(run_dir) else ""
        raise UserError(f"{run_dir}: not a run folder (no {runlog.CONFIG_FILE}){hint}")
    return run_dir


def run_config(run_dir: Path) -> Config:
    """The run's resolved config.toml."""
    from retrain.config.loader import load_config

    path = Path(run_dir) / runlog.CONFIG_FILE
    try:
        return load_config(path)
    except ConfigError as exc:
        raise UserError(f"{path}: the run's config does not load ({exc}); restore it") from None


def checkpoints(run_dir: Path) -> dict[int, Checkpoint]:
    """Every kept checkpoint by step: resume points whose checkpoint still exists in the run
    folder (local) or names a tinker:// path, and the one state.json names."""
    return _survey(Path(run_dir))[0]


def survey(run_dir: Path) -> tuple[dict[int, Checkpoint], dict[int, str]]:
    """(every kept checkpoint by step, why each other step with a resume point has none)."""
    found, problems = _survey(Path(run_dir))
    return found, {step: why for step, why in problems if step not in found}


def _survey(run_dir: Path) -> tuple[dict[int, Checkpoint], list[tuple[int, str]]]:
    """(the kept checkpoints by step, (step, why) of each other record that names none). A
    record names its checkpoint relative to the run folder; older ones by a path of which only
    the name counts (runlog.own_checkpoint): a run folder only ever uses its own checkpoints."""
    found: dict[int, Checkpoint] = {}
    problems: list[tuple[int, str]] = []
    for source, step, ref in _records(run_dir):
        if not isinstance(step, int) or isinstance(step, bool) or step <= 0 \
                or not isinstance(ref, str) or not ref:
            continue
        try:
            own = runlog.own_checkpoint(run_dir, ref)
        except ValueError as exc:
            problems.append((step, f"{source}: {exc}"))
            continue
        if not own.startswith(TINKER_SCHEME) and not weight_files(Path(own)):
            problems.append((step, _no_weights(source, run_dir, Path(own))))
            continue
        found[step] = Checkpoint(step, own)
    return found, problems


def _no_weights(source: str, run_dir: Path, folder: Path) -> str:
    where = f"{run_dir}/{runlog.CHECKPOINT_DIR}/{folder.name}"
    if folder.is_dir():
        return (f"{source} names checkpoint {folder.name}, but {where} has no {ADAPTER_CONFIG} "
                f"(nor {MODEL_CONFIG}): its files are incomplete")
    return (f"{source} names checkpoint {folder.name}, but {where} is missing (deleted, or "
            "the run folder was copied without it)")


def weight_files(folder: Path) -> tuple[str, ...]:
    """The files that load checkpoint `folder`: a LoRA adapter's, a whole model's (a full
    fine-tuning run), or none."""
    if (folder / ADAPTER_CONFIG).is_file():
        return ADAPTER_FILES
    if (folder / MODEL_CONFIG).is_file():
        return MODEL_FILES
    return ()


def _records(run_dir: Path) -> list[tuple[str, object, object]]:
    """(file, step, checkpoint ref) of every resume point, then of state.json."""
    folder = run_dir / runlog.CHECKPOINT_DIR
    try:
        points = sorted(p for p in folder.iterdir() if p.name.endswith(POINT_SUFFIX))
    except OSError:
        points = []
    out: list[tuple[str, object, object]] = []
    for path in points:
        point = runlog.read_json(path) or {}
        out.append((f"{runlog.CHECKPOINT_DIR}/{path.name}",
                    runlog.checkpoint_step(path.name.removesuffix(POINT_SUFFIX)),
                    point.get("checkpoint")))
    state = runlog.read_json(run_dir / runlog.STATE_FILE) or {}
    out.append((runlog.STATE_FILE, state.get("step"), state.get("checkpoint")))
    return out


def pick(run_dir: Path, step: int | None) -> Checkpoint:
    """The checkpoint of `step`, or the newest; UserError naming the kept steps otherwise."""
    found, problems = _survey(Path(run_dir))
    if not found and problems:
        raise UserError(f"{run_dir}: no usable checkpoint: {problems[-1][1]}")
    if not found:
        raise UserError(f"{run_dir}: no checkpoint yet (has the run finished a step?)")
    if step is None:
        return found[max(found)]
    if step not in found:
        kept = ", ".join(str(s) for s in sorted(found))
        raise UserError(f"--step {step}: {run_dir} keeps no checkpoint of that step; kept "
                        f"steps: {kept} (training.save_every decides which are kept)")
    return found[step]


@contextmanager
def held(run_dir: Path, step: int | None) -> Iterator[Checkpoint]:
    """`pick`, its weight files copied (or linked) aside first and loaded from there: a run still
    training prunes older checkpoints, so the newest may vanish between the pick and the load.
    Then the newest is picked again; a `step` asked for by number that vanished is an error."""
    with tempfile.TemporaryDirectory(prefix="retrain-checkpoint-") as tmp:
        for _ in range(PICKS):
            ckpt = pick(run_dir, step)
            if ckpt.is_tinker:
                break
            copy = _copy_adapter(ckpt.folder, Path(tmp))
            if copy is not None:
                ckpt = replace(ckpt, copy=copy)
                break
            if step is not None:
                raise UserError(f"--step {step}: {run_dir} deleted that checkpoint while it "
                                "was being read (a run still training keeps only every "
                                "training.save_every-th); pick a kept step")
        else:
            raise UserError(f"{run_dir}: its newest checkpoint was deleted {PICKS} times while "
                            "being read; try again")
        yield ckpt


def _copy_adapter(folder: Path, tmp: Path) -> Path | None:
    """A copy of the adapter files of checkpoint `folder` under `tmp`; None when the folder
    was deleted meanwhile; UserError when it stays but lacks a file (damaged)."""
    copy = tmp / folder.name
    shutil.rmtree(copy, ignore_errors=True)
    copy.mkdir()
    names = weight_files(folder) or ADAPTER_FILES
    names += tuple(n for n in OPTIONAL_FILES if names == MODEL_FILES and (folder / n).is_file())
    try:
        for name in names:
            _link_or_copy(folder / name, copy / name)
        return copy
    except FileNotFoundError as exc:
        time.sleep(GONE_S)  # a prune in progress removes the files, then the folder
        if not folder.exists():
            return None
        raise UserError(f"checkpoint {folder} is damaged: {Path(exc.filename or '').name or exc}"
                        " is missing; pick another with --step") from None


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link where the file system allows (a checkpoint's files are never rewritten in
    place, and a whole model is large), else a copy."""
    try:
        os.link(src, dst)
    except FileNotFoundError:
        raise
    except OSError:
        shutil.copyfile(src, dst)

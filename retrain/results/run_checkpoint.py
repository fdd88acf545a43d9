"""Which checkpoint of a run the results commands use, and the run's own config.

A run folder holds `config.toml` (the resolved config, file references absolute) and one
resume point per kept checkpoint (`checkpoints/step-N.json`, naming the checkpoint: a local
folder or a `tinker://` path); `state.json` names the newest. Read through runlog/safejson.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from retrain.config.sections import Config, ConfigError
from retrain.errors import UserError
from retrain.runfiles import runlog

TINKER_SCHEME = "tinker://"
POINT_SUFFIX = ".json"


@dataclass(frozen=True)
class Checkpoint:
    """One saved step: its number and where its weights are (a folder or a tinker:// path)."""

    step: int
    ref: str

    @property
    def is_tinker(self) -> bool:
        return self.ref.startswith(TINKER_SCHEME)

    @property
    def folder(self) -> Path:
        return Path(self.ref)


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
    """Every kept checkpoint by step: resume points whose checkpoint still exists (local) or
    names a tinker:// path, and the one state.json names."""
    folder = Path(run_dir) / runlog.CHECKPOINT_DIR
    found: dict[int, Checkpoint] = {}
    refs = []
    try:
        points = sorted(p for p in folder.iterdir() if p.name.endswith(POINT_SUFFIX))
    except OSError:
        points = []
    for path in points:
        point = runlog.read_json(path) or {}
        refs.append((runlog.checkpoint_step(path.name.removesuffix(POINT_SUFFIX)),
                     point.get("checkpoint")))
    state = runlog.read_json(Path(run_dir) / runlog.STATE_FILE) or {}
    refs.append((state.get("step"), state.get("checkpoint")))
    for step, ref in refs:
        if not isinstance(step, int) or isinstance(step, bool) or step <= 0 \
                or not isinstance(ref, str) or not ref:
            continue
        if not ref.startswith(TINKER_SCHEME):
            ref = _local(folder, ref)
            if ref is None:
                continue
        found[step] = Checkpoint(step, ref)
    return found


def _local(folder: Path, ref: str) -> str | None:
    """A local checkpoint folder that holds an adapter (found by name when the run folder
    was moved), else None."""
    for path in (Path(ref), folder / Path(ref).name):
        if (path / "adapter_config.json").is_file():
            return str(path)
    return None


def pick(run_dir: Path, step: int | None) -> Checkpoint:
    """The checkpoint of `step`, or the newest; UserError naming the kept steps otherwise."""
    found = checkpoints(run_dir)
    if not found:
        raise UserError(f"{run_dir}: no checkpoint yet (has the run finished a step?)")
    if step is None:
        return found[max(found)]
    if step not in found:
        kept = ", ".join(str(s) for s in sorted(found))
        raise UserError(f"--step {step}: {run_dir} keeps no checkpoint of that step; kept "
                        f"steps: {kept} (training.save_every decides which are kept)")
    return found[step]

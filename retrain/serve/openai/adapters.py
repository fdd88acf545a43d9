"""`retrain serve --adapter NAME=RUN_DIR[@STEP]`: a run's checkpoint served under a model
name beside the base model (the OpenAI routes sample it by that name).

The checkpoints are found as `retrain sample` finds them (`results.run_checkpoint`), before the
model loads (a bad folder fails in a second), then the newest that loads is loaded once as a
frozen adapter on the served model. One rule for a checkpoint that cannot be served, whatever
is wrong with it (a resume point naming a folder without its adapter_config.json, weights that
are truncated or do not load): without @STEP the next older checkpoint is served, and the
server says which step and why at start; a STEP asked for by number is never swapped for
another (its error says why). A run
trained through this server (`backend = "tinker"` against `retrain serve`) names a
tinker:// checkpoint that is one of this server's own folders: served too. Anything wrong is
a UserError naming the flag, before the server listens.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrain.errors import UserError
from retrain.results import run_checkpoint
from retrain.serve.checkpoints import CheckpointStore
from retrain.serve.engine import Engine
from retrain.serve.errors import ApiError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
FORM = "NAME=RUN_DIR[@STEP], e.g. --adapter math=logs/run@20"


@dataclass(frozen=True)
class AdapterSpec:
    """One `--adapter` as given."""

    name: str
    run_dir: Path
    step: int | None


@dataclass(frozen=True)
class AdapterRun:
    """A spec whose run folder and checkpoints were found: `ckpts` are the ones to try, newest
    first (only STEP's when the flag names one); `unusable`, why each other step with a resume
    point has no checkpoint to load."""

    spec: AdapterSpec
    run_dir: Path
    ckpts: tuple[run_checkpoint.Checkpoint, ...]
    model: str            # the run's model.name
    chat_template: bool   # the run's data.chat_template
    unusable: dict[int, str] = field(default_factory=dict)

    @property
    def flag(self) -> str:
        return f"--adapter {self.spec.name}={self.spec.run_dir}"


@dataclass(frozen=True)
class ServedAdapter:
    """A loaded checkpoint: its engine snapshot and how its run rendered chats."""

    name: str
    snap: Any
    run_dir: Path
    step: int
    chat_template: bool
    created: int
    skipped: dict[int, str] = field(default_factory=dict)  # newer steps, and why not served

    def fallback_line(self) -> str | None:
        """Why a step older than the run's newest is served, or None when it is the newest."""
        if not self.skipped:
            return None
        why = "; ".join(f"step {s}: {w}" for s, w in sorted(self.skipped.items(), reverse=True))
        return (f"adapter {self.name!r}: serving step {self.step}, the newest readable "
                f"checkpoint of {self.run_dir}, not step {max(self.skipped)} ({why})")


def parse_spec(text: str) -> AdapterSpec:
    """'NAME=RUN_DIR[@STEP]'; a trailing @digits is the step (a folder may hold '@')."""
    name, eq, rest = text.partition("=")
    name = name.strip()
    if not eq or not name or not rest.strip():
        raise UserError(f"--adapter {text!r}: give {FORM}")
    if not _NAME.match(name) or name.startswith("tinker:"):
        raise UserError(f"--adapter {text!r}: the name {name!r} must be letters, digits, "
                        "'.', '_', '-', ':' or '/' (at most 128), not a tinker:// path")
    step = None
    folder, at, tail = rest.rpartition("@")
    if at and tail.isdigit():
        rest, step = folder, int(tail)
        if step < 1:
            raise UserError(f"--adapter {text!r}: STEP must be >= 1")
    return AdapterSpec(name, Path(rest).expanduser(), step)


def find_runs(specs: list[AdapterSpec]) -> list[AdapterRun]:
    """Each spec's run folder, config and checkpoints; UserError naming the flag."""
    runs: list[AdapterRun] = []
    for spec in specs:
        flag = f"--adapter {spec.name}={spec.run_dir}"
        if any(r.spec.name == spec.name for r in runs):
            raise UserError(f"{flag}: the name {spec.name!r} is given twice; pick another")
        try:
            run_dir = run_checkpoint.check_run_dir(spec.run_dir)
            cfg = run_checkpoint.run_config(run_dir)
            ckpts, unusable = _candidates(run_dir, spec.step)
        except UserError as exc:
            raise UserError(f"{flag}: {exc}") from None
        if cfg.model.finetune == "full":
            raise UserError(f"{flag}: the run trained every weight (model.finetune = 'full'), "
                            "so it has no LoRA adapter to serve; export it (retrain export "
                            "RUN_DIR OUT) and serve that folder: retrain serve --model OUT")
        runs.append(AdapterRun(spec, run_dir, ckpts, cfg.model.name, cfg.data.chat_template,
                               unusable))
    return runs


def _candidates(run_dir: Path, step: int | None
                ) -> tuple[tuple[run_checkpoint.Checkpoint, ...], dict[int, str]]:
    """The checkpoints to try, newest first, and why the other steps have none: STEP's alone
    when given (a step asked for by number is never swapped for another)."""
    found, unusable = run_checkpoint.survey(run_dir)
    if step is not None and step in unusable:
        raise UserError(f"step {step}: {unusable[step]}")
    if step is not None or not found:
        return (run_checkpoint.pick(run_dir, step),), {}
    return tuple(found[s] for s in sorted(found, reverse=True)), unusable


def load_adapters(engine: Engine, store: CheckpointStore,
                  runs: list[AdapterRun]) -> dict[str, ServedAdapter]:
    """Every run's newest readable checkpoint loaded on `engine`, by name: a checkpoint whose
    files are incomplete or do not load is passed over for the next older one (the reason is
    kept in `skipped`); UserError on a clash with the base model's name, another base model,
    or when no checkpoint loads."""
    served: dict[str, ServedAdapter] = {}
    for run in runs:
        if engine.accepts(run.spec.name):
            raise UserError(f"{run.flag}: {run.spec.name!r} is the base model's name; pick "
                            "another")
        _check_base(engine, run.model, run.run_dir, run.flag)
        skipped = dict(run.unusable)
        for ckpt in run.ckpts:
            try:
                snap = engine.read_snapshot(_folder(store, ckpt))
            except Exception as exc:  # missing or damaged files, or not on this server
                skipped[ckpt.step] = f"cannot load {ckpt.ref}: {_first_line(exc)}"
                continue
            newer = {s: why for s, why in skipped.items() if s > ckpt.step}
            served[run.spec.name] = ServedAdapter(run.spec.name, snap, run.run_dir, ckpt.step,
                                                  run.chat_template, int(time.time()), newer)
            break
        else:
            newest = max(c.step for c in run.ckpts)
            raise UserError(f"{run.flag}: no checkpoint loads; step {newest}: "
                            f"{skipped[newest]}")
    return served


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, ApiError):
        return f"it is not on this server ({exc.message}); serve it where it was trained"
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def _check_base(engine: Engine, model: str, run_dir: Path, flag: str) -> None:
    """The run trained on the model this server serves (by name, or by the same folder)."""
    from retrain.backends.models import resolve_model

    if engine.accepts(model):
        return
    try:
        if engine.accepts(resolve_model(model, run_dir)):
            return
    except UserError:
        pass
    raise UserError(f"{flag}: the run trained {model!r}, but this server serves "
                    f"{engine.base_model!r}; start a retrain serve with --model {model}")


def _folder(store: CheckpointStore, ckpt: run_checkpoint.Checkpoint) -> Path:
    """The checkpoint's folder: its own, or this server's for a tinker:// one (ApiError when
    this server has none)."""
    if not ckpt.is_tinker:
        return ckpt.folder
    folder, _ = store.find(ckpt.ref, None)
    return folder

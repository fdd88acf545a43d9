"""`retrain serve --adapter NAME=RUN_DIR[@STEP]`: a run's checkpoint served under a model
name beside the base model (the OpenAI routes sample it by that name).

The checkpoint is found as `retrain sample` finds it (`results.run_checkpoint`: the newest
kept step, or STEP), before the model loads (a bad folder fails in a second), then loaded
once as a frozen adapter on the served model. A run
trained through this server (`backend = "tinker"` against `retrain serve`) names a
tinker:// checkpoint that is one of this server's own folders: served too. Anything wrong is
a UserError naming the flag, before the server listens.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
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
    """A spec whose run folder and checkpoint were found."""

    spec: AdapterSpec
    run_dir: Path
    ckpt: run_checkpoint.Checkpoint
    model: str            # the run's model.name
    chat_template: bool   # the run's data.chat_template

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
    """Each spec's run folder, config and checkpoint; UserError naming the flag."""
    runs: list[AdapterRun] = []
    for spec in specs:
        flag = f"--adapter {spec.name}={spec.run_dir}"
        if any(r.spec.name == spec.name for r in runs):
            raise UserError(f"{flag}: the name {spec.name!r} is given twice; pick another")
        try:
            run_dir = run_checkpoint.check_run_dir(spec.run_dir)
            cfg = run_checkpoint.run_config(run_dir)
            ckpt = run_checkpoint.pick(run_dir, spec.step)
        except UserError as exc:
            raise UserError(f"{flag}: {exc}") from None
        if cfg.model.finetune == "full":
            raise UserError(f"{flag}: the run trained every weight (model.finetune = 'full'), "
                            "so it has no LoRA adapter to serve; export it (retrain export "
                            "RUN_DIR OUT) and serve that folder: retrain serve --model OUT")
        runs.append(AdapterRun(spec, run_dir, ckpt, cfg.model.name, cfg.data.chat_template))
    return runs


def load_adapters(engine: Engine, store: CheckpointStore,
                  runs: list[AdapterRun]) -> dict[str, ServedAdapter]:
    """Every run's checkpoint loaded on `engine`, by name; UserError on a clash with the
    base model's name, another base model, or files that do not load."""
    served: dict[str, ServedAdapter] = {}
    for run in runs:
        if engine.accepts(run.spec.name):
            raise UserError(f"{run.flag}: {run.spec.name!r} is the base model's name; pick "
                            "another")
        _check_base(engine, run.model, run.run_dir, run.flag)
        folder = _folder(store, run.ckpt, run.flag)
        try:
            snap = engine.read_snapshot(folder)
        except Exception as exc:  # missing or damaged files
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise UserError(f"{run.flag}: cannot load the checkpoint {run.ckpt.ref}: "
                            f"{first}") from None
        served[run.spec.name] = ServedAdapter(run.spec.name, snap, run.run_dir, run.ckpt.step,
                                              run.chat_template, int(time.time()))
    return served


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


def _folder(store: CheckpointStore, ckpt: run_checkpoint.Checkpoint, flag: str) -> Path:
    if not ckpt.is_tinker:
        return ckpt.folder
    try:
        folder, _ = store.find(ckpt.ref, None)
    except ApiError as exc:
        raise UserError(f"{flag}: step {ckpt.step} is {ckpt.ref}, which is not on this "
                        f"server ({exc.message}); serve it where it was trained") from None
    return folder

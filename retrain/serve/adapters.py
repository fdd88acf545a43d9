"""`retrain serve --adapter NAME=RUN_DIR[@STEP]`: a run's checkpoint served under a model
name beside the base model (the OpenAI routes sample it by that name).

The checkpoint is found as `retrain sample` finds it (`results.run_checkpoint`: the newest
kept step, or STEP) and loaded once at start as a frozen adapter on the served model. A run
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


def load_adapters(engine: Engine, store: CheckpointStore,
                  specs: list[AdapterSpec]) -> dict[str, ServedAdapter]:
    """Every spec loaded on `engine`, by name; UserError on a clash or a bad run."""
    served: dict[str, ServedAdapter] = {}
    for spec in specs:
        if spec.name in served or engine.accepts(spec.name):
            raise UserError(f"--adapter {spec.name}=...: the name {spec.name!r} is taken "
                            "(the base model or another --adapter); pick another")
        served[spec.name] = _load(engine, store, spec)
    return served


def _load(engine: Engine, store: CheckpointStore, spec: AdapterSpec) -> ServedAdapter:
    flag = f"--adapter {spec.name}={spec.run_dir}"
    try:
        run_dir = run_checkpoint.check_run_dir(spec.run_dir)
        cfg = run_checkpoint.run_config(run_dir)
        ckpt = run_checkpoint.pick(run_dir, spec.step)
    except UserError as exc:
        raise UserError(f"{flag}: {exc}") from None
    _check_base(engine, cfg.model.name, run_dir, flag)
    folder = _folder(store, ckpt, flag)
    try:
        snap = engine.read_snapshot(folder)
    except Exception as exc:  # missing or damaged files
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise UserError(f"{flag}: cannot load the checkpoint {ckpt.ref}: {first}") from None
    return ServedAdapter(spec.name, snap, run_dir, ckpt.step, cfg.data.chat_template,
                         int(time.time()))


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

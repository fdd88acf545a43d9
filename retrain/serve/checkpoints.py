"""Served checkpoints on disk: `tinker://<run>/<kind>/<name>` paths <-> folders under
`<state dir>/runs/`, each with a `meta.json` naming its base model; written atomically."""

from __future__ import annotations

import json
import re
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from retrain.serve.errors import ApiError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_KINDS = {"weights": "training", "sampler_weights": "sampler"}


class CheckpointStore:
    """Checkpoints of one server (one base model) under `state_dir`."""

    def __init__(self, state_dir: Path, base_model: str):
        self.state_dir = Path(state_dir)
        self.base_model = base_model

    def place(self, model_id: str, kind: str, name: str) -> tuple[str, Path]:
        """The tinker:// path and the folder of checkpoint `name` of a model."""
        if not _NAME.match(name):
            raise ApiError(400, f"checkpoint name {name!r} must be letters, digits, '.', '_' "
                           "or '-' (at most 128)")
        run_id = model_id.replace(":", "-")
        return f"tinker://{run_id}/{kind}/{name}", self.state_dir / "runs" / run_id / kind / name

    def find(self, path: str, want_kind: str | None) -> tuple[Path, dict]:
        """The folder and meta of an existing checkpoint of this base model."""
        parts = path[len("tinker://"):].split("/") if path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] not in _KINDS or not all(_NAME.match(p) for p in parts):
            raise ApiError(400, f"{path!r} is not a tinker://<run>/weights/<name> path")
        if want_kind is not None and parts[1] != want_kind:
            raise ApiError(400, f"{path!r}: load_weights needs a training checkpoint "
                           "(tinker://<run>/weights/<name>), not sampler weights")
        folder = self.state_dir / "runs" / parts[0] / parts[1] / parts[2]
        try:
            meta = json.loads((folder / "meta.json").read_text())
        except (OSError, ValueError):
            raise ApiError(404, f"no checkpoint at {path} on this server") from None
        if meta.get("base_model") != self.base_model:
            raise ApiError(400, f"{path} was saved from {meta.get('base_model')!r}, but this "
                           f"server serves {self.base_model!r}")
        return folder, meta

    def delete(self, path: str) -> None:
        folder, _ = self.find(path, None)
        shutil.rmtree(folder, ignore_errors=True)

    def write_atomically(self, folder: Path, write: Callable[[Path], None], meta: dict) -> None:
        """Write a checkpoint into a temp folder, then rename it into place (runs in a thread)."""
        tmp = folder.parent / f".{folder.name}.{uuid.uuid4().hex[:6]}.tmp"
        tmp.mkdir(parents=True)
        try:
            write(tmp)
            meta = {**meta, "base_model": self.base_model, "created": time.time()}
            (tmp / "meta.json").write_text(json.dumps(meta))
            if folder.exists():
                shutil.rmtree(folder)
            tmp.rename(folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

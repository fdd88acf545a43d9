"""Exporting a tinker:// checkpoint: the service's checkpoint archive, through the SDK."""

from __future__ import annotations

from pathlib import Path

from retrain.errors import UserError
from retrain.results.run_checkpoint import Checkpoint


def download(ckpt: Checkpoint, out: Path) -> None:
    """Fetch the archive of `ckpt` into `out` where the service offers one; else say what to
    do instead."""
    raise UserError(f"step {ckpt.step} is a tinker checkpoint ({ckpt.ref}); retrain cannot "
                    "download it yet: fetch it with the tinker CLI or SDK "
                    "(`tinker checkpoint download`), or train with backend = 'local' to export")

"""Optional experiment trackers (Weights & Biases, TensorBoard), imported only when configured."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from retrain.config.sections import LoggingConfig
from retrain.errors import UserError


class Trackers:
    """Mirrors each metrics row to the configured trackers; numbers only."""

    def __init__(self, logging: LoggingConfig, run_dir: Path, config: dict):
        """`config`: the resolved config as a TOML-shaped dict (W&B records it)."""
        self._sinks: list[Any] = []
        if logging.wandb_project:
            self._sinks.append(_wandb(logging, run_dir, config))
        if logging.tensorboard:
            self._sinks.append(_tensorboard(run_dir))

    def log(self, row: dict) -> None:
        numbers = {k: float(v) for k, v in row.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        for sink in self._sinks:
            sink.log(numbers, int(row["step"]))

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


class _WandbSink:
    def __init__(self, run: Any):
        self.run = run

    def log(self, numbers: dict, step: int) -> None:
        self.run.log(numbers, step=step)

    def close(self) -> None:
        self.run.finish()


class _TensorBoardSink:
    def __init__(self, writer: Any):
        self.writer = writer

    def log(self, numbers: dict, step: int) -> None:
        for key, value in numbers.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _wandb(logging: LoggingConfig, run_dir: Path, config: dict) -> _WandbSink:
    try:
        import wandb
    except ImportError:
        raise UserError("logging.wandb_project is set but wandb is not installed; "
                        "pip install wandb, or remove logging.wandb_project") from None
    # A stable id per run folder: a resumed run keeps logging into the same W&B run.
    run_id = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]
    run = wandb.init(project=logging.wandb_project, name=logging.run_name, id=run_id,
                     resume="allow", config=config, dir=str(run_dir))
    return _WandbSink(run)


def _tensorboard(run_dir: Path) -> _TensorBoardSink:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError("logging.tensorboard = true needs the tensorboard package; "
                        "pip install tensorboard, or set logging.tensorboard = false") from None
    return _TensorBoardSink(SummaryWriter(log_dir=str(run_dir / "tensorboard")))

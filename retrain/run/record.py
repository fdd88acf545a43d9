"""What a run writes about itself when its steps start: config.toml (the resolved config,
re-runnable as is) and the trackers that [logging] names. run_single renders it once from the
Config, so the stages that open it (run/sft.py, run/trainer.py) are handed no whole Config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from retrain.config.loader import dumps_config, to_dict
from retrain.config.sections import Config, LoggingConfig
from retrain.run.trackers import Trackers
from retrain.runfiles import runlog


@dataclass(frozen=True)
class RunRecord:
    config_toml: str        # the resolved config as config.toml holds it
    config: dict            # the same, as the trackers record it
    logging: LoggingConfig  # run_name, and which trackers

    @classmethod
    def of(cls, cfg: Config) -> RunRecord:
        return cls(dumps_config(cfg), to_dict(cfg), cfg.logging)

    @property
    def run_name(self) -> str:
        return self.logging.run_name

    def open(self, run_dir: Path) -> Trackers:
        """Write config.toml (rewritten on every launch) and start the trackers; called after
        a resume point loaded, so that a failed resume leaves the folder untouched."""
        run_dir.mkdir(parents=True, exist_ok=True)
        runlog.replace_atomically(run_dir / runlog.CONFIG_FILE, self.config_toml.encode("utf-8"))
        return Trackers(self.logging, run_dir, self.config)

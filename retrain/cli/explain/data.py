"""What `retrain explain` reads of a run's data, read as the run reads it: [sft.data] (its
conversations and the stage's steps) and, for a run with RL steps, [data] (its problems and
held-out split). Bad data is the run's own one-line error now, not at the start of the run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from retrain.config import toml_io
from retrain.config.sections import Config, to_dict


@dataclass(frozen=True)
class DataPlan:
    """The data of one run as explain shows it."""

    sft: str = ""        # the SFT stage's line ("" without one)
    sft_steps: int = 0   # the stage's steps, before the RL steps
    task: str = ""       # [data]'s line ("" without RL steps)
    sft_warning: str = ""  # conversations that can never train, counted (cli/explain_sft.py)


class DataReader:
    """Reads each distinct data setting once (a campaign's runs mostly share theirs)."""

    def __init__(self, config_dir: Path):
        self.config_dir = config_dir.resolve()
        self._read: dict[str, DataPlan] = {}

    def read(self, cfg: Config) -> DataPlan:
        """Every data source the run will read, read now."""
        rl = cfg.training.max_steps > 0  # 0: an SFT run, which reads no [data]
        key = toml_io.dumps({"sft": to_dict(cfg)["sft"], "data": to_dict(cfg)["data"],
                             "rl": {"on": rl, "seed": cfg.training.seed},
                             "model": {"name": cfg.model.name}})
        if key not in self._read:
            self._read[key] = self._plan(cfg, rl)
        return self._read[key]

    def _plan(self, cfg: Config, rl: bool) -> DataPlan:
        sft, steps, warning = "", 0, ""
        if cfg.sft.enabled:
            from retrain.cli.explain.sft import never_trained_warning
            from retrain.environments.sft.data import describe, load_sft, sft_steps

            data = load_sft(cfg.sft, self.config_dir)
            sft, steps = describe(cfg.sft, data), sft_steps(cfg.sft, data.rows)
            warning = never_trained_warning(cfg, data, self.config_dir)
        task = task_line(cfg, self.config_dir) if rl else ""
        return DataPlan(sft=sft, sft_steps=steps, task=task, sft_warning=warning)


def task_line(cfg: Config, config_dir: Path) -> str:
    """[data]'s problems as the run splits them (a UserError on data the run would refuse)."""
    from retrain.environments.tasks import data_path, load_task

    data = cfg.data
    splits = load_task(data, cfg.training.seed, config_dir)
    where = str(data_path(data, config_dir)) if data.source == "jsonl" else \
        data.path if data.source == "hf" else f"built-in {data.source}"
    return f"{where}: {len(splits.train)} training problems, {len(splits.eval)} held out"

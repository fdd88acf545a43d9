"""The config's sections that a run's RL steps read (run/trainer.py and the parts it builds):
run_single hands the Trainer these, not the whole Config (no [model], [backend], [sft] or
[logging]: the backend and the run's record carry what those say)."""

from __future__ import annotations

from dataclasses import dataclass

from retrain.config.cost_section import CostConfig
from retrain.config.sections import (
    AlgorithmConfig,
    BackpressureConfig,
    Config,
    DataConfig,
    EnvironmentConfig,
    RewardConfig,
    TrainingConfig,
)


@dataclass(frozen=True)
class RlSections:
    training: TrainingConfig
    data: DataConfig
    environment: EnvironmentConfig
    reward: RewardConfig
    algorithm: AlgorithmConfig
    backpressure: BackpressureConfig
    cost: CostConfig

    @classmethod
    def of(cls, cfg: Config) -> RlSections:
        return cls(cfg.training, cfg.data, cfg.environment, cfg.reward, cfg.algorithm,
                   cfg.backpressure, cfg.cost)

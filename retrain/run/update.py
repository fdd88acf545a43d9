"""A step's update: the loss the [algorithm] section names, `forward_backward` over the step's
datums, then one `optim_step` with the training section's AdamW settings."""

from __future__ import annotations

from dataclasses import dataclass

from retrain.algorithms.losses import eps_of
from retrain.backends.base import (
    AdamParams,
    Backend,
    Datum,
    LossConfig,
    LossOutput,
    OptimOutput,
    skipped_nonfinite,
)

NO_UPDATE = {"loss": 0.0, "grad_norm": 0.0, "skipped_nonfinite": False,
             "sampler_trainer_logprob_diff": None, "grad_noise_scale": None,
             "grad_coherence": None}


@dataclass
class Update:
    """What one update did: the backend's outputs, and whether the optimizer skipped it."""

    loss: LossOutput
    optim: OptimOutput

    @property
    def skipped(self) -> bool:
        """A non-finite loss or gradient: the weights were left as they were."""
        return skipped_nonfinite(self.optim.metrics)


def loss_config(algorithm, training) -> LossConfig:
    """The [algorithm] section's loss, as the backends take it."""
    return LossConfig(name=algorithm.loss, clip_eps=eps_of(algorithm.clip_eps),
                      clip_eps_high=eps_of(algorithm.clip_eps_high),
                      clip_ratio_c=algorithm.clip_ratio_c, dro_beta=algorithm.dro_beta,
                      aggregation=algorithm.loss_aggregation, max_tokens=training.max_tokens,
                      temperature=training.temperature)


def update(backend: Backend, datums: list[Datum], algorithm, training, lr: float) -> Update:
    """forward_backward with the configured loss, then optim_step at `lr`."""
    out = backend.forward_backward(datums, loss_config(algorithm, training))
    adam = AdamParams(learning_rate=lr, beta1=training.beta1, beta2=training.beta2,
                      eps=training.adam_eps, weight_decay=training.weight_decay,
                      grad_clip_norm=training.grad_clip_norm)
    return Update(loss=out, optim=backend.optim_step(adam))

"""Full fine-tuning on the local backend (`model.finetune = "full"`): every weight trains.

`FullBackend` is a `LocalBackend` whose trained parameters are all of the model's own (no peft
wrapper, no adapter), with AdamW states for each. It owns its `LocalModel`: nothing else may
share weights that change. The KL term's reference is a frozen copy of the base weights taken
before any update (held only when `algorithm.kl_coef > 0`: it costs one more copy of the
weights), because there is no adapter to disable.

A checkpoint folder holds the model as transformers writes one (`model.safetensors`,
`config.json`, `generation_config.json`: `AutoModelForCausalLM.from_pretrained` loads it), plus
`optimizer.pt` and `rng.pt` (checkpoint).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from retrain.backends.base import BackendError, Datum
from retrain.backends.local import checkpoint
from retrain.backends.local.backend import LocalBackend
from retrain.backends.local.model import LocalModel
from retrain.backends.local.sampling import compiled

if TYPE_CHECKING:
    from retrain.config.sections import BackendConfig, ModelConfig, TrainingConfig

WEIGHTS = "model.safetensors"
NAME = "full"  # what stands in the adapter's place in the LocalBackend's calls


class FullBackend(LocalBackend):
    """Every parameter of `model` trains; `keep_reference` keeps a frozen copy of the weights
    as they are now, for `reference_logprobs`."""

    def __init__(self, model: LocalModel, *, micro_batch_size: int = 0, seed: int = 0,
                 checkpoint_dir: str | Path | None = None, keep_reference: bool = False):
        if model.peft is not None:
            raise BackendError("full fine-tuning needs a model without LoRA adapters")
        self.reference = _frozen_copy(model.base) if keep_reference else None
        super().__init__(model, NAME, micro_batch_size=micro_batch_size, seed=seed,
                         checkpoint_dir=checkpoint_dir)

    def _trainable(self) -> dict[str, torch.nn.Parameter]:
        """Every parameter once (tied embeddings are one parameter), in module order."""
        params = dict(self.model.base.named_parameters())
        for p in params.values():
            p.requires_grad_(True)
        return params

    @classmethod
    def from_config(cls, model: ModelConfig, training: TrainingConfig, backend: BackendConfig,
                    config_dir: Path | None = None, checkpoint_dir: Path | None = None,
                    keep_reference: bool = False) -> FullBackend:
        """A private LocalModel trained whole, from `[model]`, `[training]` and `[backend]
        compile`; `keep_reference` (the run's loss has a KL term) keeps the base weights."""
        loaded = LocalModel.from_config(model, training, config_dir)
        built = cls(loaded, micro_batch_size=training.micro_batch_size, seed=training.seed,
                    checkpoint_dir=checkpoint_dir, keep_reference=keep_reference)
        if compiled.wanted(backend.compile):
            loaded.compile_decoding()
        loaded.use_sampler("exact")  # the fast sampler merges LoRA layers, which are absent
        return built

    def snapshot(self, name: str | None = None) -> str:
        raise BackendError("snapshots copy a LoRA adapter; full fine-tuning has none "
                           "(retrain serve trains and serves LoRA adapters only)")

    def reference_logprobs(self, datums: list[Datum],
                           temperature: float = 1.0) -> list[list[float]]:
        """The base model's log-probs, from the frozen copy taken before any update."""
        if self.reference is None:
            raise BackendError("full fine-tuning keeps the base model for the KL term only "
                               "when algorithm.kl_coef > 0")
        return self._forward_logprobs(self.reference, datums, temperature)

    # ------------------------------------------------------------------ checkpoints

    def save_state(self, name: str) -> str:
        """Write `<checkpoint_dir>/<name>/`: the whole model + optimizer + RNG state."""
        if self.checkpoint_dir is None:
            raise BackendError("save_state needs checkpoint_dir (set by the trainer)")
        return checkpoint.write(self.checkpoint_dir / name, self.model,
                                      self.params.values(), self._write_weights,
                                      self.optimizer, self.generator, what="model")

    def _write_weights(self, folder: Path) -> None:
        from safetensors.torch import save_file

        weights = {k: v.detach().contiguous().cpu() for k, v in self._saved_weights().items()}
        save_file(weights, str(folder / WEIGHTS), metadata={"format": "pt"})
        base = self.model.base
        base.config.save_pretrained(str(folder))
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(str(folder))

    def _saved_weights(self) -> dict[str, torch.Tensor]:
        """The weights a checkpoint holds, by name (a sharded backend: its whole copy)."""
        return self.params

    def load_state(self, ref: str) -> None:
        """Restore the weights (in place: the optimizer keeps its parameters), optimizer and
        RNG from a `save_state` folder; a missing or damaged one is a BackendError."""
        checkpoint.read(ref, self.checkpoint_dir, WEIGHTS, self.model, self._load_weights,
                              self.optimizer, self.generator)

    def _load_weights(self, folder: Path) -> None:
        weights = checkpoint.finite_weights(folder / WEIGHTS, self.model.device)
        missing = sorted(set(self.params) - set(weights))
        extra = sorted(set(weights) - set(self.params))
        if missing or extra:
            raise BackendError(f"checkpoint {folder} does not match the model: missing "
                               f"{missing[:3]}, unexpected {extra[:3]}")
        with torch.no_grad():
            for key, p in self.params.items():
                p.copy_(weights[key])


def _frozen_copy(base: Any) -> Any:
    ref = copy.deepcopy(base)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref

"""A tinker:// checkpoint to sample from: the run's own Tinker backend (the SDK), restored from
the saved state, sampling exactly as the trainer's evaluation did (one request per prompt)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from retrain.backends.base import BackendError, Completion, SamplingParams, TokenIds
from retrain.config.sections import Config
from retrain.errors import UserError
from retrain.results.run_checkpoint import Checkpoint


class TinkerPolicy:
    def __init__(self, backend: Any):
        self.backend = backend

    @classmethod
    def load(cls, cfg: Config, ckpt: Checkpoint) -> TinkerPolicy:
        from retrain.backends.tinker.backend import TinkerBackend

        backend = TinkerBackend.from_config(cfg.model, cfg.training, cfg.backend)
        try:
            backend.load_state(ckpt.ref)
        except BackendError as exc:
            backend.close()
            raise UserError(f"cannot load the tinker checkpoint {ckpt.ref}: {exc}") from None
        return cls(backend)

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    @property
    def max_context(self) -> int | None:
        return self.backend.max_context  # None: the service checks it

    def sample(self, prompts: list[TokenIds], n: int, params: SamplingParams,
               chunk: int = 64) -> list[list[Completion]]:
        out: list[list[Completion]] = []
        try:
            for i in range(0, len(prompts), chunk):
                out += self.backend.sample(prompts[i:i + chunk], n, params)
        except BackendError as exc:
            raise UserError(f"sampling the tinker checkpoint failed: {exc}") from None
        return out

    def stream(self, prompt: TokenIds, params: SamplingParams) -> Iterator[int]:
        """The completion's tokens (the service answers whole completions: no streaming)."""
        yield from self.sample([prompt], 1, params)[0][0].tokens

    def close(self) -> None:
        self.backend.close()

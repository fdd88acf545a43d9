"""The models the OpenAI routes serve, by name: the base model, every `--adapter`, the Tinker
clients' live sampling sessions (by sampling session id), and the sampler checkpoints saved
on this server (by tinker:// path). `/v1/models` lists them; `target` finds the weights a
request samples from.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from retrain.runfiles import runlog
from retrain.serve.errors import ApiError
from retrain.serve.openai.adapters import ServedAdapter
from retrain.serve.openai.wire import OpenAIError
from retrain.serve.tinker.service import TinkerService

SAVED_LISTED = 200  # sampler checkpoints listed at most (the newest)


@dataclass(frozen=True)
class Target:
    """What one request samples from; `owned`: a snapshot loaded for it, dropped after."""

    model: str
    snap: Any
    chat_template: bool
    owned: bool = False


class Catalog:
    """Model names -> weights, over the Tinker service's state and the `--adapter`s."""

    def __init__(self, service: TinkerService, adapters: dict[str, ServedAdapter]):
        self.service = service
        self.adapters = adapters
        self.started = int(time.time())

    def models(self) -> list[dict]:
        """The /v1/models list: base first, then adapters, live samplers, saved ones."""
        engine = self.service.engine
        base = engine.base_model
        cards = [self._card(base, self.started, None)]
        cards += [self._card(a.name, a.created, base, run_dir=str(a.run_dir), step=a.step)
                  for a in self.adapters.values()]
        cards += [self._card(sid, self.started, base)
                  for sid, s in list(self.service.samplers.items()) if s.snap is not None]
        cards += [self._card(path, created, base) for path, created in self._saved()]
        return cards

    def card(self, name: str) -> dict:
        for card in self.models():
            if card["id"] == name:
                return card
        raise _unknown(name)

    def _card(self, name: str, created: int, parent: str | None, **extra: Any) -> dict:
        return {"id": name, "object": "model", "created": int(created), "owned_by": "retrain",
                "root": name if parent is None else parent, "parent": parent,
                "max_model_len": self.service.engine.max_context, **extra}

    def _saved(self) -> list[tuple[str, int]]:
        """tinker:// paths of the sampler checkpoints of this base model, newest first."""
        runs = self.service.checkpoints.state_dir / "runs"
        found = []
        for meta_file in runs.glob("*/sampler_weights/*/meta.json"):
            meta = runlog.read_json(meta_file) or {}
            created = meta.get("created")
            if meta.get("base_model") == self.service.engine.base_model \
                    and isinstance(created, int | float):
                folder = meta_file.parent
                run = folder.parent.parent.name
                found.append((f"tinker://{run}/sampler_weights/{folder.name}", int(created)))
        return sorted(found, key=lambda x: -x[1])[:SAVED_LISTED]

    async def target(self, name: str) -> Target:
        """The weights `name` names; a 404 in OpenAI's shape when none."""
        engine = self.service.engine
        if name in self.adapters:
            adapter = self.adapters[name]
            return Target(name, adapter.snap, adapter.chat_template)
        if engine.accepts(name):
            return Target(name, None, True)
        sampler = self.service.samplers.get(name)
        if sampler is not None:
            return Target(name, sampler.snap, True)
        if name.startswith("tinker://"):
            try:
                folder, _ = self.service.checkpoints.find(name, None)
            except ApiError as exc:
                raise OpenAIError(exc.status, f"model: {exc.message}", "model",
                                  code="model_not_found" if exc.status == 404 else None) \
                    from None
            snap = await self._in_pool(engine.read_snapshot, folder)
            return Target(name, snap, True, owned=True)
        raise _unknown(name)

    async def release(self, target: Target) -> None:
        if target.owned:
            await self._in_pool(self.service.engine.drop_snapshot, target.snap)

    async def _in_pool(self, fn, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.service.pool, fn, *args)


def _unknown(name: str) -> OpenAIError:
    return OpenAIError(404, f"the model {name!r} does not exist on this server (GET /v1/models "
                       "lists the base model, --adapter names and Tinker sampler weights)",
                       "model", code="model_not_found")

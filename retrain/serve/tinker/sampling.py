"""Sampling in `retrain serve`: sampling sessions, sample requests, and the work of a client
that is gone.

A sample request runs in a worker thread for as long as its decode takes (2048
completions: minutes), holding the model that every other request waits for. Its work is
cancelled (the decode stops between two tokens) when its client is gone: its session ended
(finished, or no heartbeat: `TinkerService.reap_sessions`), or the connection of the last
poll open on its future closed (`poll_abandoned`: noticed at once), or no poll has been
open on it for UNPOLLED_S (a live SDK client always has one open), or the server stops.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tinker import types

from retrain.serve.checkpoints import CheckpointStore
from retrain.serve.door import validate
from retrain.serve.door.backlog import Backlog, owed
from retrain.serve.engine import Engine
from retrain.serve.errors import ApiError
from retrain.serve.tinker import wire
from retrain.serve.tinker.futures import FutureStore, Reply

log = logging.getLogger("retrain.serve")

SAMPLERS_KEPT_PER_MODEL = 8  # ephemeral sampler snapshots kept per training model
# A future nobody has polled for this long has lost its client. Long enough for a client
# backing off from errors on its polls (the SDK waits up to 30 s between tries).
UNPOLLED_S = 60.0


@dataclass
class Sampler:
    sampler_id: str
    snap: Any                    # engine snapshot; None = the base model
    model_path: str | None = None
    session_id: str = ""         # the session it belongs to ("" for a one-off request)


class RunningSamples:
    """The cancel flag of every sample request still running, and whose session it is."""

    def __init__(self):
        self._flags: dict[str, tuple[threading.Event, str]] = {}
        self.stopped = 0  # requests that ended cancelled (their client gone, the server stopping)

    def __len__(self) -> int:
        return len(self._flags)

    def __iter__(self):
        return iter(list(self._flags))  # the request ids

    def cancelled(self) -> int:
        """Requests still running whose cancel flag is set (they leave at the next step)."""
        return sum(flag.is_set() for flag, _ in self._flags.values())

    def start(self, request_id: str, session_id: str) -> threading.Event:
        flag = threading.Event()
        self._flags[request_id] = (flag, session_id)
        return flag

    def finish(self, request_id: str) -> None:
        flag, _ = self._flags.pop(request_id, (None, ""))
        self.stopped += flag is not None and flag.is_set()

    def cancel(self, why: str, keep: Callable[[str, str], bool] = lambda rid, sid: False
               ) -> list[str]:
        """Cancel every running request but those `keep(request_id, session_id)` keeps."""
        gone = [rid for rid, (flag, sid) in self._flags.items()
                if not flag.is_set() and not keep(rid, sid)]
        for rid in gone:
            self._flags[rid][0].set()
            log.info("sample request %s cancelled: %s", rid, why)
        return gone


class SamplingOps:
    """The sampling half of `TinkerService` (a mixin: the service holds the state)."""

    engine: Engine
    futures: FutureStore
    checkpoints: CheckpointStore
    sessions: dict
    samplers: dict[str, Sampler]
    running: RunningSamples
    backlog: Backlog
    _samples: dict[tuple[str, int], dict]
    _session: Callable
    _check_base: Callable
    _in_thread: Callable
    _run: Callable

    async def create_sampling_session(self, req: types.CreateSamplingSessionRequest) -> dict:
        session = self._session(req.session_id)
        sampler_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        if sampler_id in self.samplers:
            return {"type": "create_sampling_session", "sampling_session_id": sampler_id}
        snap = None
        if req.model_path:
            folder, _ = self.checkpoints.find(req.model_path, None)
            snap = await self._in_thread(self.engine.read_snapshot, folder)
        else:
            self._check_base(req.base_model)
        self._add_sampler(Sampler(sampler_id, snap, req.model_path), session.session_id)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def get_sampler(self, sampler_id: str) -> dict:
        sampler = self._sampler(sampler_id)
        return {"sampler_id": sampler_id, "base_model": self.engine.base_model,
                "model_path": sampler.model_path}

    def _add_sampler(self, sampler: Sampler, session_id: str) -> None:
        sampler.session_id = session_id
        self.samplers[sampler.sampler_id] = sampler
        self.sessions[session_id].samplers.add(sampler.sampler_id)

    def _sampler(self, sampler_id: str) -> Sampler:
        sampler = self.samplers.get(sampler_id)
        if sampler is None:
            raise ApiError(404, f"unknown or expired sampler {sampler_id!r}; this server keeps "
                           f"the last {SAMPLERS_KEPT_PER_MODEL} sampler snapshots per model")
        return sampler

    async def _request_sampler(self, req: types.SampleRequest) -> tuple[Sampler, bool]:
        """The request's sampler, and whether it is a snapshot loaded for this call only
        (a legacy request naming a checkpoint)."""
        if req.sampling_session_id:
            return self._sampler(req.sampling_session_id), False
        if req.model_path:
            folder, _ = self.checkpoints.find(req.model_path, None)
            return Sampler("", await self._in_thread(self.engine.read_snapshot, folder)), True
        self._check_base(req.base_model)
        return Sampler("", None), False

    async def asample(self, req: types.SampleRequest) -> dict:
        sampler, own_snapshot = await self._request_sampler(req)
        key = (sampler.sampler_id, req.seq_id)
        if sampler.sampler_id and req.seq_id is not None and key in self._samples:
            return self._samples[key]  # a retried submit
        prompt = wire.prompt_tokens(req.prompt)
        params = wire.sampling_params(req.sampling_params)
        validate.check_sample(prompt, req.num_samples, params, self.engine.vocab_size,
                              self.engine.max_context)
        validate.check_sample_extras(req.topk_prompt_logprobs, req.topk_sample_logprobs,
                                     req.target_prompt_logprobs, req.prompt_alt_tokens_k)
        try:
            taken = self.backlog.take(owed([len(prompt)], req.num_samples, params.max_tokens))
        except ApiError:
            if own_snapshot:
                await self._in_thread(self.engine.drop_snapshot, sampler.snap)
            raise
        request_id = self.futures.create()
        reply = {"request_id": request_id,
                 "sample_sequence_ids": [f"{request_id}:{i}" for i in range(req.num_samples)]}
        if sampler.sampler_id and req.seq_id is not None:
            self._samples[key] = reply
            if len(self._samples) > 100_000:  # bounded memory for long-lived servers
                self._samples.pop(next(iter(self._samples)))
        cancel = self.running.start(request_id, sampler.session_id)

        def work():
            try:
                return self.engine.sample(sampler.snap, prompt, req.num_samples, params,
                                          bool(req.prompt_logprobs), cancel)
            finally:
                if own_snapshot:
                    self.engine.drop_snapshot(sampler.snap)

        async def job():
            try:
                return await self._in_thread(work)
            finally:
                self.running.finish(request_id)
                self.backlog.give_back(taken)

        self._run(request_id, job, lambda result: Reply(proto=wire.encode_sample(result)))
        return reply

    def poll_abandoned(self, request_id: str) -> None:
        """A poll on `request_id` ended because its client hung up. With no other poll open
        on it, nobody is waiting: the SDK holds its poll until an answer (its timeout, 45 s,
        is past the server's hold) and re-polls a broken one at once, so its client is gone
        (killed, or it gave up on the future) and its sampling stops now, not at session end."""
        if self.futures.polls(request_id) == 0:
            self.running.cancel("its client hung up its poll",
                                lambda rid, sid: rid != request_id)

    def cancel_unpolled(self, after_s: float = UNPOLLED_S) -> list[str]:
        """Cancel the sample requests nobody has polled for `after_s` (their client died)."""
        return self.running.cancel(f"not polled for {after_s:g} s",
                                   lambda rid, sid: self.futures.unpolled_s(rid) < after_s)

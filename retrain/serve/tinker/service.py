"""The Tinker API's semantics over an Engine: sessions, models, samplers, futures, checkpoints.

Independent of HTTP: `app.py` parses requests into the SDK's own pydantic types and calls
these methods on the event loop. Engine work runs in a thread pool; training ops of one
model run in seq_id order (`ordering.Sequencer`), sampling runs concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinker import types

from retrain.backends.base import AdamParams
from retrain.serve.checkpoints import CheckpointStore, string_map
from retrain.serve.door import validate
from retrain.serve.door.backlog import Backlog
from retrain.serve.engine import Engine, EngineError
from retrain.serve.errors import ApiError, final_refusal
from retrain.serve.tinker import wire
from retrain.serve.tinker.futures import FutureStore, Reply
from retrain.serve.tinker.ordering import GAP_S, Sequencer
from retrain.serve.tinker.sampling import (
    SAMPLERS_KEPT_PER_MODEL,
    UNPOLLED_S,
    RunningSamples,
    Sampler,
    SamplingOps,
)

log = logging.getLogger("retrain.serve")

# No heartbeat (nor other call) for this long: the session ends and its adapters are freed.
# The SDK heart-beats every 10 s (each try times out after 10 s), so this is two missed
# beats and some slack; with the reaper's period the place of a killed client is free
# within SESSION_TIMEOUT_S + REAP_EVERY_S = 30 s of its last heartbeat.
SESSION_TIMEOUT_S = 25.0
REAP_EVERY_S = 5.0


@dataclass
class Session:
    session_id: str
    last_seen: float = field(default_factory=time.monotonic)
    models: set[str] = field(default_factory=set)
    samplers: set[str] = field(default_factory=set)
    finished: bool = False


@dataclass
class Model:
    model_id: str
    session_id: str
    rank: int
    seq: Sequencer = field(default_factory=Sequencer)
    samplers: list[str] = field(default_factory=list)  # ephemeral sampler ids, oldest first
    user_metadata: dict[str, str] = field(default_factory=dict)  # kept in its checkpoints


class TinkerService(SamplingOps):
    """All server state; every method runs on the event loop thread."""

    def __init__(self, engine: Engine, state_dir: Path, futures: FutureStore | None = None,
                 workers: int = 32, max_sessions: int = 0,
                 session_timeout_s: float = SESSION_TIMEOUT_S, order_gap_s: float = GAP_S,
                 unpolled_s: float = UNPOLLED_S, backlog: Backlog | None = None):
        self.engine = engine
        self.backlog = backlog or Backlog()  # sampling taken on and not done (429 past it)
        self.unpolled_s = unpolled_s  # a sample nobody polls for this long is cancelled
        self.order_gap_s = order_gap_s  # a missing seq_id is given up after this (ordering)
        self.session_timeout_s = session_timeout_s
        self.max_sessions = max_sessions  # training clients alive at once (0 = no limit)
        self.state_dir = Path(state_dir)
        self.checkpoints = CheckpointStore(self.state_dir, engine.base_model)
        self.futures = futures or FutureStore()
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="retrain-serve")
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, Sampler] = {}
        self._creating: dict[str, str] = {}          # model_id -> request id of its creation
        self._samples: dict[tuple[str, int], dict] = {}  # (sampler, seq_id) -> asample reply
        self._tasks: set[asyncio.Task] = set()
        self.running = RunningSamples()

    # ------------------------------------------------------------------ sessions

    def create_session(self, req: types.CreateSessionRequest) -> dict:
        session_id = f"sess-{uuid.uuid4().hex[:12]}"
        self.sessions[session_id] = Session(session_id)
        return {"type": "create_session", "session_id": session_id}

    def heartbeat(self, session_id: str) -> dict:
        session = self.sessions.get(session_id)
        if session is None or session.finished:
            raise ApiError(410, f"session {session_id} is over")
        session.last_seen = time.monotonic()
        return {"type": "session_heartbeat"}

    def finish_session(self, session_id: str) -> dict:
        session = self.sessions.get(session_id)
        if session is not None:
            self._close_session(session)
        return {}

    def reap_sessions(self, timeout_s: float | None = None) -> list[str]:
        """Close sessions whose client stopped heart-beating (a crashed worker)."""
        timeout_s = self.session_timeout_s if timeout_s is None else timeout_s
        now = time.monotonic()
        gone = [s for s in self.sessions.values()
                if not s.finished and now - s.last_seen > timeout_s]
        for session in gone:
            log.info("session %s timed out; freeing its adapters", session.session_id)
            self._close_session(session)
        return [s.session_id for s in gone]

    def _close_session(self, session: Session) -> None:
        session.finished = True
        self.running.cancel(f"its session {session.session_id} ended",
                            lambda rid, sid: sid != session.session_id)
        for sampler_id in session.samplers:
            self._drop_sampler(sampler_id)
        for model_id in session.models:
            if model_id in self.models:
                self.models[model_id].seq.when_idle(lambda m=model_id: self._drop_model(m))

    def _drop_sampler(self, sampler_id: str) -> None:
        sampler = self.samplers.pop(sampler_id, None)
        if sampler is not None and sampler.snap is not None:
            self._background(self._in_thread(self.engine.drop_snapshot, sampler.snap))

    def _drop_model(self, model_id: str) -> None:
        if self.models.pop(model_id, None) is not None:
            self._background(self._in_thread(self.engine.drop_adapter, model_id))

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.finished:
            raise ApiError(404, f"unknown or finished session {session_id!r}; create a new "
                           "ServiceClient")
        session.last_seen = time.monotonic()
        return session

    # ------------------------------------------------------------------ models

    def create_model(self, req: types.CreateModelRequest) -> dict:
        session = self._session(req.session_id)
        self._check_base(req.base_model)
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        if model_id in self._creating:  # a retried submit
            return {"request_id": self._creating[model_id], "model_id": model_id}
        rank = req.lora_config.rank if req.lora_config else 32
        seed = req.lora_config.seed if req.lora_config else None
        validate.check_lora_rank(rank)
        request_id = self._reserve_model(session, model_id)

        def create() -> None:
            self.engine.create_adapter(model_id, rank, seed)

        self._run(request_id, self._model_job(session, model_id, rank, create,
                                              string_map(req.user_metadata)),
                  lambda _: {"type": "create_model", "model_id": model_id})
        return {"request_id": request_id, "model_id": model_id}

    def _reserve_model(self, session: Session, model_id: str) -> str:
        """Take a training-client place for `model_id` (429 when --max-sessions are taken)."""
        if self.max_sessions and self.live_sessions() >= self.max_sessions:
            raise ApiError(429, f"retrain serve is at its limit of {self.max_sessions} "
                           "concurrent training clients (--max-sessions); retry when one "
                           "finishes")
        request_id = self.futures.create()
        self._creating[model_id] = request_id
        session.models.add(model_id)  # counted from now on, freed when the session ends
        return request_id

    def live_sessions(self) -> int:
        """Training clients (LoRA adapters) alive or being created in unfinished sessions."""
        return sum(len(s.models) for s in self.sessions.values() if not s.finished)

    def _model_job(self, session: Session, model_id: str, rank: int, create: Callable,
                   user_metadata: dict[str, str]):
        """The job that builds a model's adapter in a thread, then registers the model."""
        async def job() -> None:
            try:
                await self._in_thread(create)
            except BaseException:  # free the place and whatever half-built adapter exists
                session.models.discard(model_id)
                self._creating.pop(model_id, None)
                self._background(self._in_thread(self.engine.drop_adapter, model_id))
                raise
            self.models[model_id] = Model(model_id, session.session_id, rank,
                                          Sequencer(gap_s=self.order_gap_s),
                                          user_metadata=user_metadata)
            if session.finished:  # the session ended while the adapter was being built
                self._drop_model(model_id)
        return job

    def get_info(self, model_id: str) -> dict:
        model = self._model(model_id)
        name = self.engine.base_model
        return {"type": "get_info", "model_id": model_id, "is_lora": True,
                "lora_rank": model.rank, "model_name": name,
                "model_data": {"arch": self.engine.arch, "model_name": name,
                               "tokenizer_id": self.engine.tokenizer_id},
                "optimizer_config": {"type": "adamw"}}

    def _model(self, model_id: str) -> Model:
        model = self.models.get(model_id)
        if model is None:
            raise ApiError(404, f"unknown model_id {model_id!r} (finished, timed out, or "
                           "created on another server)")
        self.sessions[model.session_id].last_seen = time.monotonic()
        return model

    def _check_base(self, base_model: str | None) -> None:
        if base_model and not self.engine.accepts(base_model):
            raise ApiError(400, f"this server serves {self.engine.base_model!r}, not "
                           f"{base_model!r}; set model.name to match `retrain serve --model`")

    def _ordered(self, model: Model, seq_id: int | None, job: Callable, encode: Callable) -> dict:
        """Queue a training op on `model` in seq_id order; a repeated seq_id is a retry."""
        if (known := self._retried(model, seq_id)) is not None:
            return known
        request_id = self.futures.create()
        try:
            model.seq.submit(seq_id, request_id, lambda: self._execute(request_id, job, encode))
        except ValueError as exc:  # not 409: the SDK would send it again for 5 minutes
            raise ApiError(400, str(exc)) from None
        return {"request_id": request_id, "model_id": model.model_id}

    @staticmethod
    def _retried(model: Model, seq_id: int | None) -> dict | None:
        """The reply already given to `seq_id` (a retried submit), if any."""
        if seq_id is not None and (known := model.seq.seen(seq_id)) is not None:
            return {"request_id": known, "model_id": model.model_id}
        return None

    @contextlib.contextmanager
    def _vetting(self, model: Model, seq_id: int | None) -> Iterator[None]:
        """Checks of a training request: one they refuse still completes its place in the
        model's order, or the client's next op would wait for it forever."""
        try:
            yield
        except (ApiError, validate.RequestError) as exc:
            if seq_id is not None and final_refusal(exc):
                model.seq.skip(seq_id)
            raise

    def refused(self, model_id: object, seq_id: object) -> None:
        """A training request refused before it could be read (a bad body): its place in
        the model's order is done, so the client's next op runs."""
        model = self.models.get(model_id) if isinstance(model_id, str) else None
        if model is not None and isinstance(seq_id, int) and seq_id > 0:
            model.seq.skip(seq_id)

    # ------------------------------------------------------------------ training

    def forward_backward(self, call: wire.FwdBwdCall) -> dict:
        model = self._model(call.model_id)
        with self._vetting(model, call.seq_id or None):
            validate.check_datums(call.data, call.config, self.engine.vocab_size,
                                  self.engine.max_context)

        def work():
            return self.engine.forward_backward(model.model_id, call.data, call.loss_fn,
                                                call.config, call.forward_only)

        return self._ordered(model, call.seq_id or None, lambda: self._in_thread(work),
                             lambda result: Reply(proto=wire.encode_forward_backward(result)))

    def optim_step(self, req: types.OptimStepRequest) -> dict:
        model = self._model(req.model_id)
        p = req.optim_params
        with self._vetting(model, req.seq_id):
            if not isinstance(p, types.AdamParams):
                raise ApiError(400, "retrain serve supports the adamw optimizer only")
            adam = AdamParams(learning_rate=p.learning_rate, beta1=p.beta1, beta2=p.beta2,
                              eps=p.eps, weight_decay=p.weight_decay,
                              grad_clip_norm=p.grad_clip_norm)
            validate.check_adam(adam)
        return self._ordered(
            model, req.seq_id,
            lambda: self._in_thread(self.engine.optim_step, model.model_id, adam),
            lambda metrics: Reply(json={"type": "optim_step", "metrics": metrics}))

    def save_weights(self, req: types.SaveWeightsRequest) -> dict:
        model = self._model(req.model_id)
        if (known := self._retried(model, req.seq_id)) is not None:
            return known  # before the check below: the first try may have written it
        name = req.path or f"ckpt-{uuid.uuid4().hex[:8]}"
        with self._vetting(model, req.seq_id):
            path, folder = self.checkpoints.place(model.model_id, "weights", name)
            if folder.exists() and not req.overwrite:  # 400, not 409: the SDK retries 409s
                raise ApiError(400, f"checkpoint {path} exists; pass overwrite=True to "
                               "replace it")

        def work():
            self.checkpoints.write_atomically(
                folder, lambda tmp: self.engine.save_state(model.model_id, tmp),
                {"rank": model.rank, "kind": "training", "user_metadata": model.user_metadata})

        return self._ordered(model, req.seq_id, lambda: self._in_thread(work),
                             lambda _: Reply(json={"type": "save_weights", "path": path}))

    def save_weights_for_sampler(self, req: types.SaveWeightsForSamplerRequest) -> dict:
        model = self._model(req.model_id)
        if req.path is None:
            return self._ephemeral_sampler(model, req)
        with self._vetting(model, req.seq_id):
            path, folder = self.checkpoints.place(model.model_id, "sampler_weights", req.path)

        def work():
            snap = self.engine.snapshot(model.model_id)
            try:
                self.checkpoints.write_atomically(
                    folder, lambda tmp: self.engine.write_snapshot(snap, tmp),
                    {"rank": model.rank, "kind": "sampler",
                     "user_metadata": model.user_metadata})
            finally:
                self.engine.drop_snapshot(snap)

        return self._ordered(model, req.seq_id, lambda: self._in_thread(work),
                             lambda _: Reply(json={"path": path}))

    def _ephemeral_sampler(self, model: Model, req: types.SaveWeightsForSamplerRequest) -> dict:
        sampler_id = f"{model.session_id}:sample:{req.sampling_session_seq_id}"

        async def job():
            snap = await self._in_thread(self.engine.snapshot, model.model_id)
            self._add_sampler(Sampler(sampler_id, snap), model.session_id)
            model.samplers.append(sampler_id)
            while len(model.samplers) > SAMPLERS_KEPT_PER_MODEL:
                self._drop_sampler(model.samplers.pop(0))

        return self._ordered(model, req.seq_id, job,
                             lambda _: Reply(json={"sampling_session_id": sampler_id}))

    def load_weights(self, req: types.LoadWeightsRequest) -> dict:
        if req.model_id is not None:  # into an existing model, in its seq order
            model = self._model(req.model_id)
            with self._vetting(model, req.seq_id):
                folder, _ = self.checkpoints.find(req.path, "weights")
            return self._ordered(
                model, req.seq_id,
                lambda: self._in_thread(self.engine.load_state, model.model_id, folder,
                                        req.optimizer),
                lambda _: Reply(json={"path": req.path, "model_id": model.model_id}))
        folder, meta = self.checkpoints.find(req.path, "weights")
        if req.session_id is None or req.model_seq_id is None:
            raise ApiError(400, "load_weights needs model_id, or session_id and model_seq_id")
        session = self._session(req.session_id)
        self._check_base(req.base_model)
        model_id = f"{req.session_id}:train:{req.model_seq_id}"  # the SDK derives this id too
        if model_id in self._creating:
            return {"request_id": self._creating[model_id], "model_id": model_id}
        rank = int(meta["rank"])
        request_id = self._reserve_model(session, model_id)

        def create() -> None:
            self.engine.create_adapter(model_id, rank, None)
            self.engine.load_state(model_id, folder, req.optimizer)

        metadata = string_map(req.user_metadata) or string_map(meta.get("user_metadata"))
        self._run(request_id, self._model_job(session, model_id, rank, create, metadata),
                  lambda _: {"path": req.path, "model_id": model_id})
        return {"request_id": request_id, "model_id": model_id}

    # ------------------------------------------------------------------ checkpoints

    def get_training_run(self, run_id: str) -> dict:
        """GET training_runs/<run>: what tinker-cookbook reads back on resume (the renderer
        in user_metadata), from the live model or else its newest checkpoint."""
        live = next((m for m in self.models.values()
                     if m.model_id.replace(":", "-") == run_id), None)
        run = self.checkpoints.training_run(
            run_id, (live.rank, live.user_metadata) if live else None)
        if run is None:
            raise ApiError(404, f"no training run {run_id!r} on this server")
        return run

    def delete_checkpoint(self, run_id: str, checkpoint_id: str) -> dict:
        """DELETE training_runs/<run>/checkpoints/<kind>/<name> (rolling checkpoints)."""
        self.checkpoints.delete(f"tinker://{run_id}/{checkpoint_id}")
        return {}

    # ------------------------------------------------------------------ plumbing

    async def _in_thread(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def _run(self, request_id: str, job: Callable, encode: Callable) -> None:
        """Run `job` now (not ordered) and resolve `request_id` with its encoded result."""
        self._background(self._execute(request_id, job, encode))

    async def _execute(self, request_id: str, job: Callable, encode: Callable) -> None:
        try:
            result = await job()
            reply = encode(result)
            if not isinstance(reply, Reply):
                reply = Reply(json=reply)
        except EngineError as exc:
            reply = Reply(error=str(exc), category="user")
        except ApiError as exc:
            reply = Reply(error=exc.message, category="user")
        except Exception as exc:  # a bug or an OOM: the client gets a message, the log the trace
            log.exception("request %s failed", request_id)
            reply = Reply(error=f"server error: {type(exc).__name__}: {exc}", category="server")
        self.futures.resolve(request_id, reply)

    def _background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def reap(self) -> None:
        """The periodic sweep: sessions that stopped heart-beating, samples nobody polls."""
        self.reap_sessions()
        self.cancel_unpolled(self.unpolled_s)

    def close(self) -> None:
        """Stop: queued work is dropped, running samples stop (nobody will read them)."""
        self.running.cancel("the server is stopping")
        self.pool.shutdown(wait=False, cancel_futures=True)

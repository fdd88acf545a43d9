"""The Tinker backend: the Backend contract on the official `tinker` SDK (pinned version).

- Sampling goes through a sampling client that is refreshed (save_weights_for_sampler)
  after every optimizer step, so completions always come from the current weights.
  `sample_async` submits a batch on the current sampler and returns at once (the trainer's
  off-policy overlap samples the next step while this one trains).
- `forward_backward` submits at once and returns a result that is fetched on first use;
  `optim_step` queues the optimizer step right behind it and the sampler save right behind
  the step, then waits for the step (the new sampler is read when next sampling).
- A new training client refused with HTTP 429 (the service's session limit) is queued: the
  slot is given back, the backend waits with backoff and jitter, and asks again.
- Every API request holds one of the campaign's API slots while it is on the wire, and
  only then: a request the SDK backs off (429/5xx) waits for its re-send with the slot given
  back, and takes one again to send (`tinker_slot_lease`). A call never holds a slot while
  it waits for another, so workers cannot deadlock.
- Every wait has a deadline (`backend.request_timeout_s`); a terminal failure raises
  BackendError with a message that says what to do. The API key is read only from
  $TINKER_API_KEY and is scrubbed from every message this module produces.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.metadata
import logging
import math
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from retrain import runlog
from retrain.backends import tinker_slot_lease as slot_lease
from retrain.backends.base import BackendError, LossOutput, OptimOutput, finished
from retrain.backends.stop_strings import cut_at_stop_strings
from retrain.backends.tinker_overload import HTTP_LOGGER, watch_overload
from retrain.backends.tinker_pending import PendingLoss, SampleJob
from retrain.backends.tinker_rate_limit import (
    QUEUES_429_HEADER,
    RateLimited,
    RateLimitWait,
    is_rate_limited,
    retry_after_s,
    stop_sdk_retrying_429,
)
from retrain.backends.tinker_wire import advantage_scale, completion_of, stop_ids, wire_datum
from retrain.errors import UserError
from retrain.slots import ApiSlots, NoSlots

if TYPE_CHECKING:  # the contract's datatypes this backend only names in signatures
    from retrain.backends.base import (
        AdamParams,
        Completion,
        Datum,
        LossConfig,
        SamplingParams,
        TokenIds,
    )
    from retrain.config import Config

log = logging.getLogger("retrain.tinker")
TINKER_VERSION = "0.38.0"
KEY_ENV = "TINKER_API_KEY"
SAMPLE_THREADS = 32


def check_sdk() -> None:
    """Fail early, and clearly, when the SDK is missing or not the pinned version."""
    try:
        installed = importlib.metadata.version("tinker")
    except importlib.metadata.PackageNotFoundError:
        raise UserError(f"backend = 'tinker' needs the tinker SDK: pip install "
                        f"'retrain[tinker]' (tinker=={TINKER_VERSION})") from None
    if installed != TINKER_VERSION:
        raise UserError(f"backend = 'tinker' is built and tested against tinker=="
                        f"{TINKER_VERSION}, but {installed} is installed; run pip install "
                        f"'tinker=={TINKER_VERSION}' (the wire protocol changes between "
                        "versions)")


class _Secret:
    """Holds the API key only to scrub it from messages; never prints it."""

    def __init__(self, value: str):
        self._value = value

    def scrub(self, text: str) -> str:
        return text.replace(self._value, "***") if self._value else text

    def __repr__(self) -> str:
        return "_Secret(***)"


class TinkerBackend:
    """Sampling and LoRA training on a Tinker service (hosted, or `retrain serve`)."""

    def __init__(self, *, base_model: str, lora_rank: int, seed: int, base_url: str | None,
                 request_timeout_s: float, slots: ApiSlots | None = None,
                 keep_every: int = 0, final_step: int | None = None):
        check_sdk()
        key = os.environ.get(KEY_ENV, "")
        if not key:
            raise UserError(f"backend = 'tinker' needs ${KEY_ENV} in the environment (the key "
                            "is never read from config files)")
        self._secret = _Secret(key)
        del key
        import tinker

        self._tinker = tinker
        self.base_model = base_model
        self.lora_rank = lora_rank
        self.seed = seed
        self.base_url = base_url or os.environ.get("TINKER_BASE_URL") or None
        self.timeout_s = request_timeout_s
        self.slots: ApiSlots = slots or NoSlots()
        self._overload = None if isinstance(self.slots, NoSlots) else \
            watch_overload(self.slots.record_error)  # a campaign: its controller counts them
        self._keepers = None  # threads that hold slots for calls (tinker_slot_lease)
        if not isinstance(self.slots, NoSlots):
            slot_lease.install()  # before the ServiceClient makes its HTTP clients
            self._keepers = concurrent.futures.ThreadPoolExecutor(
                2 * SAMPLE_THREADS + 2, thread_name_prefix="tinker-slot")
        self._service = tinker.ServiceClient(base_url=self.base_url, default_headers_overrides={
            QUEUES_429_HEADER: "1"})  # retrain serve: no SDK retries of its 429s (we queue)
        self._training: Any = None
        self._sampler: Any = None
        self._next_sampler: tuple[concurrent.futures.Future, threading.Event] | None = None
        self._tokenizer: Any = None
        self._pending: PendingLoss | None = None
        self._broken: str | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(SAMPLE_THREADS,
                                                           thread_name_prefix="tinker-call")
        # Sampling has its own threads, so a batch sampled during training (off-policy
        # overlap) never delays the training requests queued behind it.
        self._sample_pool = concurrent.futures.ThreadPoolExecutor(
            SAMPLE_THREADS, thread_name_prefix="tinker-sample")
        self._keep_every = keep_every
        self._final_step = final_step
        self._saved: list[tuple[str, str]] = []  # (name, tinker path), oldest first
        self._saved_lock = threading.Lock()      # appended to by the thread of each save
        self._deletions: list[concurrent.futures.Future] = []
        self._rest: Any = None
        self.rate_limit_wait_s = 0.0  # time spent waiting out 429s (part of api_wait_s)
        self.summary = f"{base_model} on Tinker ({self.base_url or 'the SDK default service'})"
        self.cost_model = None  # the service's hardware and kernels are not ours to estimate
        self._wait_lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg: Config, slots: ApiSlots | None = None) -> TinkerBackend:
        """`[backend] backend = "tinker"`: base model = model.name, rank = model.lora_rank."""
        if cfg.training.temperature != 1.0:
            warnings.warn("Tinker computes training log-probs at temperature 1, so "
                          f"training.temperature = {cfg.training.temperature} biases the "
                          "importance ratio; use 1.0 with backend = 'tinker'", stacklevel=2)
        return cls(base_model=cfg.model.name, lora_rank=cfg.model.lora_rank,
                   seed=cfg.training.seed, base_url=cfg.backend.base_url or None,
                   request_timeout_s=cfg.backend.request_timeout_s, slots=slots,
                   keep_every=cfg.training.save_every, final_step=cfg.training.max_steps)

    # ------------------------------------------------------------------ plumbing

    def _fail(self, what: str, exc: BaseException) -> BackendError:
        tinker = self._tinker
        if isinstance(exc, TimeoutError):
            hint = (f"no answer within backend.request_timeout_s = {self.timeout_s:g} s; the "
                    "run stops here and resumes from its last checkpoint when started again")
        elif isinstance(exc, tinker.AuthenticationError):
            hint = f"the service rejected the API key; check ${KEY_ENV}"
        elif isinstance(exc, tinker.APIConnectionError):
            hint = f"cannot reach {self.base_url or 'the Tinker service'}; is it up?"
        else:
            hint = f"{type(exc).__name__}: {exc}"
        return BackendError(self._secret.scrub(f"tinker {what} failed: {hint}"))

    def _wait(self, what: str, future: Any, lease: slot_lease.SlotLease | None, *,
              fatal_timeout: bool = True, queue_on_429: bool = False) -> Any:
        """The future's result within the deadline, or a BackendError (never a raw SDK error).
        Time the call spent waiting for a slot again (after an overload answer) does not count
        against the deadline, as the wait for its first slot does not."""
        try:
            return _result_within(future, self.timeout_s, lease)
        except BaseException as exc:
            if queue_on_429 and is_rate_limited(exc):
                raise RateLimited(str(exc), retry_after_s(exc)) from None
            if isinstance(exc, TimeoutError):
                future.future().cancel()
                if fatal_timeout:  # the training client is stuck behind this request
                    self._broken = what
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise self._fail(what, exc) from None

    def _call(self, what: str, submit: Callable[[], Any], *, fatal_timeout: bool = True,
              submitted: threading.Event | None = None, queue_on_429: bool = False) -> Any:
        """One API request: submit, wait for the result, holding a slot while it is in flight.

        With slots shared by a campaign, the slot is held only while one of the call's HTTP
        requests is on the wire (`tinker_slot_lease`): when the SDK backs off an overload
        answer before sending again, it sleeps with the slot given back. With `queue_on_429`
        (requests that open a new training client, safe to send again), the SDK does not
        retry a 429 at all: the backend waits out a backoff itself and asks again, for as long
        as the service keeps answering 429: queued, not failed.
        """
        waiting = RateLimitWait(what)
        while True:
            self._check_usable()
            with self._lease() as lease:
                try:
                    if queue_on_429:
                        stop_sdk_retrying_429(self._service)
                    future = submit()
                except Exception as exc:
                    if not (queue_on_429 and is_rate_limited(exc)):
                        raise self._fail(what, exc) from None
                    future, reason, asked = None, str(exc), retry_after_s(exc)
                finally:
                    if submitted is not None:
                        submitted.set()
                if future is not None:
                    try:
                        return self._wait(what, future, lease, fatal_timeout=fatal_timeout,
                                          queue_on_429=queue_on_429)
                    except RateLimited as exc:
                        reason, asked = str(exc), exc.retry_after
            # the slot is free again while we sleep: other workers' requests go meanwhile
            slept = waiting.sleep(self._secret.scrub(reason), asked)
            with self._wait_lock:
                self.rate_limit_wait_s += slept

    @contextlib.contextmanager
    def _lease(self) -> Iterator[slot_lease.SlotLease | None]:
        """The slot of one call: a lease that holds it only while a request is on the wire;
        for a standalone run (no slots to share), nothing."""
        if self._keepers is None:
            yield None
            return
        lease = slot_lease.SlotLease(self.slots, self._keepers)
        token = slot_lease.CURRENT.set(lease)
        try:
            yield lease
        finally:
            slot_lease.CURRENT.reset(token)
            lease.close()

    def _submit_in_order(self, what: str, submit: Callable[[], Any]) -> concurrent.futures.Future:
        """`_call` in a worker thread; returns once the request is sent (or has failed), so the
        training client's next request is numbered after it."""
        sent = threading.Event()

        def run() -> Any:
            try:
                return self._call(what, submit, submitted=sent)
            finally:
                sent.set()  # also when the call failed before sending anything

        job = self._pool.submit(run)
        sent.wait()
        return job

    def _check_usable(self) -> None:
        if self._broken:
            raise BackendError(f"tinker {self._broken} timed out earlier, so this training "
                               "client cannot continue; the run resumes from its last "
                               "checkpoint when started again")

    @property
    def training(self) -> Any:
        """The training client, created on first use (a new LoRA adapter on the service)."""
        if self._training is None:
            self._training = self._call("create_lora_training_client", lambda: (
                self._service.create_lora_training_client(
                    base_model=self.base_model, rank=self.lora_rank, seed=self.seed)),
                queue_on_429=True)
        return self._training

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            try:
                self._tokenizer = self.training.get_tokenizer()
            except BackendError:
                raise
            except Exception as exc:
                raise self._fail("get_tokenizer", exc) from None
        return self._tokenizer

    def _refresh_sampler(self) -> None:
        tc = self.training  # (created outside the slot: never hold one while taking another)
        self._next_sampler = None
        self._sampler = self._call("save_weights_for_sampler",
                                   tc.save_weights_and_get_sampling_client)

    def _queue_sampler_refresh(self, tc: Any) -> None:
        """Save the sampler of the new weights right behind the optimizer step (the SDK keeps
        the order); it is read only when the next sample needs it, so the save's round trips
        overlap whatever the trainer does in between (checkpointing, scoring)."""
        sent = threading.Event()
        job = self._pool.submit(self._call, "save_weights_for_sampler",
                                tc.save_weights_and_get_sampling_client, submitted=sent)
        self._next_sampler = (job, sent)

    def _current_sampler(self) -> Any:
        if self._next_sampler is not None:
            job, self._next_sampler = self._next_sampler[0], None
            self._sampler = job.result()
        if self._sampler is None:
            self._refresh_sampler()
        return self._sampler

    def _sampler_job(self) -> concurrent.futures.Future:
        """The sampler of the current weights, as a future: its save may still be in flight."""
        if self._next_sampler is not None:
            return self._next_sampler[0]
        return finished(self._current_sampler)

    def _settle(self) -> None:
        """Finish a forward_backward that nobody has read yet (frees its slot)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.get()

    # ------------------------------------------------------------------ the contract

    def sample(self, prompts: list[TokenIds], n: int,
               params: SamplingParams) -> list[list[Completion]]:
        """`n` completions per prompt from the current weights; one API request per prompt."""
        self._settle()
        return self.sample_async(prompts, n, params).result()

    def sample_async(self, prompts: list[TokenIds], n: int,
                     params: SamplingParams) -> SampleJob:
        """Submit the requests now, on the sampler of the current weights, and return at once.

        The sampler is captured here, so a weight update made while the job runs does not
        change which weights these completions come from (the off-policy overlap's contract).
        """
        sampler_job = self._sampler_job()
        types = self._tinker.types
        stop = sorted(stop_ids(self.tokenizer))
        # The SDK's `stop` takes token ids or strings, not both: with stop strings the EOS ids
        # are cut here afterwards (and the strings too, should the service not stop on them).
        wire_stop = list(params.stop_strings) or stop or None
        decode = self.tokenizer.decode

        def one(i: int, prompt: TokenIds) -> list[Completion]:
            sp = types.SamplingParams(
                max_tokens=params.max_tokens, temperature=params.temperature,
                top_p=params.top_p, stop=wire_stop,
                seed=None if params.seed is None else params.seed + i)
            sampler = sampler_job.result()  # its save may still be landing: wait here, not above
            res = self._call("sample", lambda: sampler.sample(
                types.ModelInput.from_ints(list(prompt)), n, sp), fatal_timeout=False)
            out = [cut_at_stop_strings(completion_of(s, set(stop)), params.stop_strings, decode)
                   for s in res.sequences]
            self.slots.record(completions=len(out), tokens=sum(len(c.tokens) for c in out))
            return out

        return SampleJob([self._sample_pool.submit(one, i, p) for i, p in enumerate(prompts)])

    def forward_backward(self, datums: list[Datum], loss: LossConfig) -> LossOutput:
        """Submit at once; the numbers are fetched when first read (or by optim_step)."""
        self._settle()
        if not datums:
            raise BackendError("forward_backward needs at least one datum")
        scale = advantage_scale(datums)
        data = [wire_datum(self._tinker.types, d, scale) for d in datums]
        config = None
        if loss.name == "ppo":
            config = {"clip_low_threshold": 1.0 - loss.clip_eps,
                      "clip_high_threshold": 1.0 + loss.clip_eps_high}
        elif loss.name != "importance_sampling":
            raise BackendError(f"loss {loss.name!r} is not supported by the tinker backend")
        tc = self.training
        self._check_usable()
        if self._next_sampler is not None:  # keep it ahead of this call in the SDK's order
            self._next_sampler[1].wait()
        submitted = threading.Event()

        def run() -> Any:  # in a worker thread: take a slot, submit, wait
            try:
                return self._call("forward_backward",
                                  lambda: tc.forward_backward(data, loss.name, config),
                                  submitted=submitted)
            finally:
                submitted.set()

        job = self._pool.submit(run)

        def resolve() -> LossOutput:
            out = job.result()
            logprobs = [np.asarray(o["logprobs"].data, dtype=np.float64).tolist()
                        for o in out.loss_fn_outputs]
            metrics = {k: float(v) for k, v in out.metrics.items()}
            # the advantages were scaled, so Tinker's sum already is the local backend's mean
            return LossOutput(loss=metrics.get("loss:sum", float("nan")),
                              logprobs=logprobs, metrics=metrics)

        self._pending = PendingLoss(resolve, submitted)
        return self._pending

    def optim_step(self, adam: AdamParams) -> OptimOutput:
        """Queue the step right behind the pending forward_backward and the sampler save right
        behind the step; wait for the step (the sampler is read when next sampling)."""
        types = self._tinker.types
        params = types.AdamParams(learning_rate=adam.learning_rate, beta1=adam.beta1,
                                  beta2=adam.beta2, eps=adam.eps, weight_decay=adam.weight_decay,
                                  grad_clip_norm=adam.grad_clip_norm)
        tc = self.training
        pending, self._pending = self._pending, None
        if pending is not None:
            # Pipelining: the step is submitted as soon as the forward_backward is (the SDK
            # keeps them in order), each in its own thread with its own slot, so no thread
            # ever holds a slot while waiting for another.
            pending.submitted.wait()
        queued = self._submit_in_order("optim_step", lambda: tc.optim_step(params))
        self._queue_sampler_refresh(tc)
        try:
            if pending is not None:
                pending.get()
        except BaseException:
            concurrent.futures.wait([queued])
            raise
        result = queued.result()
        metrics = {k: float(v) for k, v in (result.metrics or {}).items()}
        norm = _grad_norm(metrics)
        if not math.isfinite(norm) and any(k.split(":")[0] == "grad_norm" for k in metrics):
            metrics["skipped_nonfinite"] = 1.0  # a service that reports the norm, not the skip
        return OptimOutput(grad_norm=norm, metrics=metrics)

    def save_state(self, name: str) -> str:
        """Weights + optimizer on the service; returns the tinker:// path to resume from."""
        return self.save_state_async(name).result()

    def save_state_async(self, name: str) -> concurrent.futures.Future[str]:
        """Submit the save now, behind the optimizer step and the sampler save (the SDK keeps
        the order), and return at once; the path arrives while the trainer goes on."""
        self._settle()
        tc = self.training
        if self._next_sampler is not None:
            self._next_sampler[1].wait()
        job = self._submit_in_order("save_state", lambda: tc.save_state(name, overwrite=True))
        return self._pool.submit(self._record_save, name, job)

    def _record_save(self, name: str, job: concurrent.futures.Future) -> str:
        path = job.result().path
        with self._saved_lock:
            self._saved.append((name, path))
            self._prune()
        return path

    def _prune(self) -> None:
        """Delete superseded step checkpoints on the service, like the trainer prunes its
        folder: keep every `save_every`-th, the final one, and always the newest two (the
        run's state.json names the newest only once it is written)."""
        if self._final_step is None:  # not told the run's plan: keep everything
            return
        for entry in self._saved[:-2]:
            step = runlog.checkpoint_step(entry[0])
            if step is not None and not self._keeps(step):
                self._saved.remove(entry)
                self._deletions.append(self._pool.submit(self._delete, entry[1]))

    def _keeps(self, step: int) -> bool:
        return step == self._final_step or bool(self._keep_every and step % self._keep_every == 0)

    def _delete(self, path: str) -> None:
        """Best effort: a checkpoint that cannot be deleted only costs storage."""
        def submit() -> Any:  # inside the slot: creating the client sends requests too
            if self._rest is None:
                self._rest = self._tinker.RestClient(base_url=self.base_url)
            return self._rest.delete_checkpoint_from_tinker_path(path)

        try:
            self._call("delete_checkpoint", submit, fatal_timeout=False)
        except BackendError as exc:
            log.warning("%s (checkpoint %s kept)", exc, path)

    def load_state(self, ref: str) -> None:
        """Continue from a save_state path: a new training client with weights + optimizer."""
        self._settle()
        self._training = self._call(
            "load_state", lambda: self._service.create_training_client_from_state_with_optimizer(
                ref), queue_on_429=True)
        self._refresh_sampler()

    def close(self) -> None:
        """Finish the session (best effort) and stop the worker threads."""
        with contextlib.suppress(BackendError):
            self._settle()
        concurrent.futures.wait(self._deletions, timeout=min(self.timeout_s, 10))
        try:
            with self.slots:
                self._service.close("success").result(timeout=min(self.timeout_s, 30))
        except Exception:  # closing is best effort: the service times the session out
            pass
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._sample_pool.shutdown(wait=False, cancel_futures=True)
        if self._keepers is not None:
            self._keepers.shutdown(wait=False)
        if self._overload is not None:
            logging.getLogger(HTTP_LOGGER).removeFilter(self._overload)


def _result_within(future: Any, timeout_s: float, lease: slot_lease.SlotLease | None) -> Any:
    """`future.result()`, or TimeoutError once `timeout_s` pass, not counting the time the
    lease spent waiting for slots meanwhile."""
    start = time.monotonic()
    while True:
        waited = lease.waited_s() if lease is not None else 0.0
        left = start + timeout_s + waited - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no result within {timeout_s:g} s")
        try:
            return future.result(timeout=left)
        except TimeoutError:
            if lease is None or lease.waited_s() == waited:
                raise


def _grad_norm(metrics: dict[str, float]) -> float:
    for key, value in metrics.items():
        if key.split(":")[0] == "grad_norm":
            return value
    return float("nan")

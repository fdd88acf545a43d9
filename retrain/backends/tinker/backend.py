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
  back, and takes one again to send (`calls`, `slot_lease`). A call never
  holds a slot while it waits for another, so workers cannot deadlock.
- Every wait has a deadline (`backend.request_timeout_s`); a terminal failure raises
  BackendError with a message that says what to do. The API key is read only from
  $TINKER_API_KEY and is scrubbed from every message (`sdk`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import threading
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from retrain.backends.base import BackendError, LossOutput, OptimOutput, TokenUsage
from retrain.backends.stop_strings import cut_at_stop_strings
from retrain.backends.tinker.calls import TinkerCalls
from retrain.backends.tinker.checkpoints import ServiceCheckpoints
from retrain.backends.tinker.pending import PendingLoss, SampleJob
from retrain.backends.tinker.sampler import CurrentSampler
from retrain.backends.tinker.sdk import api_key, check_sdk
from retrain.backends.tinker.wire import (
    completion_of,
    loss_normaliser,
    stop_ids,
    wire_datum,
    wire_loss_config,
)
from retrain.slots.file_slots import ApiSlots, NoSlots

if TYPE_CHECKING:  # the contract's datatypes this backend only names in signatures
    from retrain.backends.base import (
        AdamParams,
        Completion,
        Datum,
        LossConfig,
        SamplingParams,
        TokenIds,
    )
    from retrain.config.sections import BackendConfig, ModelConfig, TrainingConfig


class TinkerBackend:
    """Sampling and LoRA training on a Tinker service (hosted, or `retrain serve`)."""

    def __init__(self, *, base_model: str, lora_rank: int, seed: int, base_url: str | None,
                 request_timeout_s: float, slots: ApiSlots | None = None,
                 keep_every: int = 0, final_step: int | None = None):
        check_sdk()
        secret = api_key()
        import tinker

        self._tinker = tinker
        self.base_model = base_model
        self.lora_rank = lora_rank
        self.seed = seed
        self.base_url = base_url or os.environ.get("TINKER_BASE_URL") or None
        self.timeout_s = request_timeout_s
        self.slots: ApiSlots = slots or NoSlots()
        self._calls = TinkerCalls(tinker, base_url=self.base_url, secret=secret,
                                  timeout_s=request_timeout_s, slots=self.slots)
        self._training: Any = None
        self._sampler = CurrentSampler(self._calls, lambda: self.training)
        self._checkpoints = ServiceCheckpoints(self._calls, keep_every=keep_every,
                                               final_step=final_step)
        self._tokenizer: Any = None
        self._base_sampler: Any = None  # the base model's sampling client, for the KL reference
        self._pending: PendingLoss | None = None
        self.summary = f"{base_model} on Tinker ({self.base_url or 'the SDK default service'})"
        self.cost_model = None  # the service's hardware and kernels are not ours to estimate
        self.max_context: int | None = None  # the service checks it (a 400)
        self.token_usage = TokenUsage()

    @property
    def rate_limit_wait_s(self) -> float:
        """Time spent waiting out 429s (part of api_wait_s)."""
        return self._calls.rate_limit_wait_s

    @classmethod
    def from_config(cls, model: ModelConfig, training: TrainingConfig, backend: BackendConfig,
                    slots: ApiSlots | None = None) -> TinkerBackend:
        """`[backend] backend = "tinker"`: base model = model.name, rank = model.lora_rank."""
        if training.temperature != 1.0:
            warnings.warn("Tinker computes training log-probs at temperature 1, so "
                          f"training.temperature = {training.temperature} biases the "
                          "importance ratio; use 1.0 with backend = 'tinker'", stacklevel=2)
        return cls(base_model=model.name, lora_rank=model.lora_rank,
                   seed=training.seed, base_url=backend.base_url or None,
                   request_timeout_s=backend.request_timeout_s, slots=slots,
                   keep_every=training.save_every, final_step=training.max_steps)

    @property
    def training(self) -> Any:
        """The training client, created on first use (a new LoRA adapter on the service)."""
        if self._training is None:
            service = self._calls.service
            self._training = self._calls.call("create_lora_training_client", lambda: (
                service.create_lora_training_client(
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
                raise self._calls.fail("get_tokenizer", exc) from None
        return self._tokenizer

    def _settle(self) -> None:
        """Finish a forward_backward that nobody has read yet (frees its slot)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.get()

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
        sampler_job = self._sampler.job()
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
                seed=_prompt_seed(params, i))
            sampler = sampler_job.result()  # its save may still be landing: wait here, not above
            res = self._calls.call("sample", lambda: sampler.sample(
                types.ModelInput.from_ints(list(prompt)), n, sp), fatal_timeout=False)
            # the bill: the ids this call sent, the tokens the service returned
            self.token_usage.count(prefill=len(prompt),
                                   sampled=sum(len(s.tokens) for s in res.sequences))
            out = [cut_at_stop_strings(completion_of(s, set(stop)), params.stop_strings, decode)
                   for s in res.sequences]
            self.slots.record(completions=len(out), tokens=sum(len(c.tokens) for c in out))
            return out

        return SampleJob([self._calls.sample_pool.submit(one, i, p) for i, p in enumerate(prompts)])

    def forward_backward(self, datums: list[Datum], loss: LossConfig) -> LossOutput:
        """Submit at once; the numbers are fetched when first read (or by optim_step)."""
        self._settle()
        if not datums:
            raise BackendError("forward_backward needs at least one datum")
        norm = loss_normaliser(datums, loss)
        config = wire_loss_config(loss)
        data = [wire_datum(self._tinker.types, d, norm.scale(i), loss.name)
                for i, d in enumerate(datums)]
        tc = self.training
        self._calls.check_usable()
        self._sampler.wait_sent()  # keep its save ahead of this call in the SDK's order
        submitted = threading.Event()
        trained = sum(map(len, datums))

        def run() -> Any:  # in a worker thread: take a slot, submit, wait
            try:
                out = self._calls.call("forward_backward",
                                       lambda: tc.forward_backward(data, loss.name, config),
                                       submitted=submitted)
                self.token_usage.count(trained=trained)  # the model_input ids each datum sent
                return out
            finally:
                submitted.set()

        job = self._calls.pool.submit(run)

        def resolve() -> LossOutput:
            out = job.result()
            logprobs = [np.asarray(o["logprobs"].data, dtype=np.float64).tolist()
                        for o in out.loss_fn_outputs]
            metrics = {k: float(v) for k, v in out.metrics.items()}
            # the advantages were scaled, so Tinker's sum already is the local backend's loss
            return LossOutput(loss=metrics.get("loss:sum", float("nan")),
                              logprobs=logprobs, metrics=metrics)

        self._pending = PendingLoss(resolve, submitted)
        return self._pending

    def reference_logprobs(self, datums: list[Datum],
                           temperature: float = 1.0) -> list[list[float]]:
        """The base model's log-probs: `compute_logprobs` of a base-model sampling client, one
        request per datum. Tinker computes them at temperature 1 only."""
        if self._base_sampler is None:
            service = self._calls.service
            self._base_sampler = self._calls.call("create_sampling_client", lambda: (
                service.create_sampling_client(base_model=self.base_model)))
        types, base = self._tinker.types, self._base_sampler

        def one(d: Datum) -> list[float]:
            tokens = list(d.input_tokens[:1]) + list(d.target_tokens)
            lps = self._calls.call("compute_logprobs", lambda: base.compute_logprobs(
                types.ModelInput.from_ints(tokens)), fatal_timeout=False)
            self.token_usage.count(prefill=len(tokens))
            return [float(lps[i + 1]) if m and lps[i + 1] is not None else 0.0
                    for i, m in enumerate(d.mask)]

        return list(self._calls.sample_pool.map(one, datums))

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
        queued = self._calls.submit_in_order("optim_step", lambda: tc.optim_step(params))
        self._sampler.queue_refresh(tc)
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
        self._sampler.wait_sent()
        return self._checkpoints.save_async(tc, name)

    def thread_metrics(self) -> dict[str, float]:
        return {}  # the service's threads are not ours to report

    def load_state(self, ref: str) -> None:
        """Continue from a save_state path: a new training client with weights + optimizer."""
        self._settle()
        self._training = self._checkpoints.load(ref)
        self._sampler.refresh()

    def close(self) -> None:
        """Finish the session (best effort) and stop the worker threads."""
        with contextlib.suppress(BackendError):
            self._settle()
        self._checkpoints.wait_deletions(min(self.timeout_s, 10))
        self._calls.close()


def _grad_norm(metrics: dict[str, float]) -> float:
    for key, value in metrics.items():
        if key.split(":")[0] == "grad_norm":
            return value
    return float("nan")


def _prompt_seed(params: SamplingParams, i: int) -> int | None:
    """The seed of the call's prompt `i`: its own (`prompt_seeds`), else the call's plus i."""
    if params.prompt_seeds is not None:
        return params.prompt_seeds[i]
    return None if params.seed is None else params.seed + i

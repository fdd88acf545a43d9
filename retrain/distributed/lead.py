"""Rank 0's backend: the Backend contract over every rank's local backend.

The run above it (trainer, environments, rewards, files) runs on rank 0 alone, unchanged.
Each sample call is split by whole prompts (a group's `n` completions stay on one rank), each
forward_backward by datums over the whole call's normaliser; the gradient is summed over the
ranks and every rank steps its own optimizer identically. Sampling draws are keyed by each
prompt's own seed (SamplingParams.prompt_seeds), so the completions are those of one process;
the rest, to float32 rounding, too. Checkpoints are rank 0's: loading one sends its weights
and optimizer to every rank, so no other rank reads the run folder.

With training sharded (`group.shard`, fsdp.py) the ranks start alike (the same files, the same
seed: nothing is sent), saving is a Save message (every rank gathers its shards of AdamW, rank
0 writes), and loading sends the checkpoint's whole tensors, which each rank slices into its
shards.
"""

from __future__ import annotations

import math
from typing import Any

from retrain.algorithms import aggregation
from retrain.backends.base import (
    AdamParams,
    BackendError,
    BackendOOMError,
    Completion,
    Datum,
    DivergedError,
    LossConfig,
    LossOutput,
    OptimOutput,
    SamplingParams,
    TokenIds,
    TokenUsage,
)
from retrain.distributed import messages as m
from retrain.distributed import shares
from retrain.distributed.group import Group

ERRORS = {"oom": BackendOOMError, "diverged": DivergedError}


def lead(backend: Any, group: Group | None) -> Any:
    """`backend` as rank 0 of `group` drives it; unchanged for a single process."""
    if group is None:
        return backend
    return LeadBackend(local(backend, group), group)


def local(backend: Any, group: Group) -> Any:
    """A rank's own backend: `backend`, or with `group.shard` its training sharded (fsdp.py)."""
    if not group.shard:
        return backend
    from retrain.distributed.fsdp import shard  # torch.distributed: only here

    return shard(backend, group)


class LeadBackend:
    """Delegates to rank 0's own backend what needs no other rank (tokenizer, checkpoints)."""

    def __init__(self, inner: Any, group: Group):
        self.inner, self.group = inner, group
        self.world_size = group.world
        self.token_usage = TokenUsage()  # the whole call's tokens, every rank's share
        self._loss_finite = True
        self.sharded = bool(getattr(inner, "sharded", False))
        if not self.sharded:  # sharded: every rank loaded the same weights, nothing to send
            self._send_weights()  # every rank starts from rank 0's adapter

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _call(self, msgs: list[Any]) -> list[Any]:
        from retrain.distributed.channel import exchange  # torch.distributed: only here

        try:
            replies = exchange(self.inner, self.group, msgs)
        except RuntimeError as exc:  # gloo/NCCL: a rank is gone, or the collective timed out
            self.group.closed = True  # nobody left to tell
            why = str(exc).split(" This is typically")[0]  # gloo adds a page of advice
            raise BackendError(f"a rank of the run left or stopped answering ({why}); the "
                               "launcher names it; rerun to resume") from exc
        for rank, reply in enumerate(replies):
            if reply.error:
                error = ERRORS.get(reply.kind, BackendError)
                raise error(reply.error if rank == 0 else f"rank {rank}: {reply.error}")
        return [r.value for r in replies]

    def _send_weights(self) -> None:
        from retrain.distributed.worker import weights_of

        self._call([weights_of(self.inner)] * self.group.world)

    # ------------------------------------------------------------------ sampling

    def sample(self, prompts: list[TokenIds], n: int, params: SamplingParams,
               adapter: str | None = None, **local: Any) -> list[list[Completion]]:
        """Split by prompts when the draws do not depend on the split; else rank 0 alone
        (one seed for the whole batch, a snapshot, streaming callbacks)."""
        if adapter is not None or any(v is not None for v in local.values()) \
                or not shares.shardable(params):
            out = self.inner.sample(prompts, n, params, adapter, **local)
        else:
            cut = shares.blocks(len(prompts), self.group.world)
            parts = self._call([m.Sample(prompts[b.start:b.stop], n, shares.split_params(
                params, b)) for b in cut])
            out = [group for part in parts for group in part]
        self.token_usage.count_sample(prompts, out)
        return out

    def sample_async(self, prompts: list[TokenIds], n: int, params: SamplingParams) -> Any:
        from retrain.backends.base import finished

        return finished(self.sample, prompts, n, params)

    # ------------------------------------------------------------------ training

    def forward_backward(self, datums: list[Datum], loss: LossConfig) -> LossOutput:
        tokens = [sum(1 for x in d.mask if x > 0) for d in datums]
        whole = aggregation.normaliser(tokens, loss.aggregation, loss.max_tokens)
        total = sum(tokens)
        cut = shares.blocks(len(datums), self.group.world)
        parts = self._call([m.Train(datums[b.start:b.stop], loss, aggregation.Normaliser(
            whole.weights[b.start:b.stop], whole.denominator), total) for b in cut])
        if total == 0:
            out = LossOutput(loss=0.0, logprobs=[[0.0] * len(d.target_tokens) for d in datums],
                             metrics={"tokens": 0.0})
        else:
            out = shares.joined_loss(parts, [sum(tokens[b.start:b.stop]) for b in cut])
        self._loss_finite = self._loss_finite and math.isfinite(out.loss)
        self.token_usage.count(trained=sum(map(len, datums)))
        return out

    def optim_step(self, adam: AdamParams) -> OptimOutput:
        finite, self._loss_finite = self._loss_finite, True
        return self._call([m.Step(adam, finite)] * self.group.world)[0]

    def logprobs(self, datums: list[Datum], temperature: float = 1.0,
                 adapter: str | None = None) -> list[list[float]]:
        if adapter is not None:
            return self.inner.logprobs(datums, temperature, adapter)
        return self._logprobs(datums, temperature, reference=False)

    def reference_logprobs(self, datums: list[Datum],
                           temperature: float = 1.0) -> list[list[float]]:
        out = self._logprobs(datums, temperature, reference=True)
        self.token_usage.count(prefill=sum(map(len, datums)))
        return out

    def _logprobs(self, datums: list[Datum], temperature: float,
                  reference: bool) -> list[list[float]]:
        cut = shares.blocks(len(datums), self.group.world)
        parts = self._call([m.Logprobs(datums[b.start:b.stop], temperature, reference)
                            for b in cut])
        return [lp for part in parts for lp in part]

    # ------------------------------------------------------------------ checkpoints

    def load_state(self, ref: str) -> None:
        """Rank 0 reads the checkpoint; every rank takes its weights and optimizer."""
        if self.sharded:  # read whole (a damaged one raises here), sliced by each rank
            self._call([self.inner.read_state(ref)] * self.group.world)
            return
        self.inner.load_state(ref)
        self._send_weights()

    def save_state(self, name: str) -> str:
        """Rank 0 writes the checkpoint; sharded, every rank gathers its part first."""
        if self.sharded:
            return self._call([m.Save(name)] * self.group.world)[0]
        return self.inner.save_state(name)

    def save_state_async(self, name: str) -> Any:
        from retrain.backends.base import finished

        if self.sharded:
            return finished(self.save_state, name)
        return self.inner.save_state_async(name)

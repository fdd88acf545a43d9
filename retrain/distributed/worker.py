"""What a rank does with a message, on its own local backend (rank 0 too, for its share).

The gradient of a forward_backward call is summed over the ranks in float32, in one flat
all-reduce of the trained parameters, after every rank's share: each share's loss is already
divided by the whole call's denominator, so the sum is the whole call's gradient, and every
rank's optimizer then takes the same step. A sharded backend (fsdp.py) runs every call on
every rank, an empty share too (its passes are collectives), and its gradients are already
summed into their shards: no all-reduce here."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from retrain.backends.base import BackendError, BackendOOMError, DivergedError, LossOutput
from retrain.distributed import messages as m
from retrain.distributed.group import Group


def execute(backend: Any, msg: Any, group: Group) -> m.Reply:
    """Run `msg` on this rank; errors come back as a Reply (the collectives still run)."""
    if isinstance(msg, m.Train):
        return _train(backend, msg, group)
    if isinstance(msg, m.Weights):
        if is_sharded(backend):
            backend.take_state(msg)
        else:
            _take_weights(backend, msg)
        return m.Reply()
    if isinstance(msg, m.Close):
        return m.Reply()
    try:
        if isinstance(msg, m.Sample):
            return m.Reply(backend.sample(msg.prompts, msg.n, msg.params) if msg.prompts else [])
        if isinstance(msg, m.Logprobs):
            if not msg.datums:
                return m.Reply([])
            call = backend.reference_logprobs if msg.reference else backend.logprobs
            return m.Reply(call(msg.datums, msg.temperature))
        if isinstance(msg, m.Step):
            backend._loss_finite = msg.loss_finite  # the whole call's, not this share's
            return m.Reply(backend.optim_step(msg.adam))
        if isinstance(msg, m.Save):
            return m.Reply(backend.save_state(msg.name))
    except Exception as exc:  # noqa: BLE001 - rank 0 raises it, named by rank
        return failed(exc)
    raise TypeError(f"unknown message {type(msg).__name__}")


def failed(exc: BaseException) -> m.Reply:
    kind = "oom" if isinstance(exc, BackendOOMError) else \
        "diverged" if isinstance(exc, DivergedError) else \
        "backend" if isinstance(exc, BackendError) else "other"
    return m.Reply(error=str(exc) or type(exc).__name__, kind=kind)


def is_sharded(backend: Any) -> bool:
    """Whether `backend` trains sharded over the ranks (fsdp.ShardedBackend)."""
    return bool(getattr(backend, "sharded", False))


def _train(backend: Any, msg: m.Train, group: Group) -> m.Reply:
    reply, out = m.Reply(), None
    sharded = is_sharded(backend)
    try:
        out = backend.forward_backward(msg.datums, msg.loss, norm=msg.norm,
                                       total_tokens=msg.tokens) if msg.datums or sharded else \
            LossOutput(loss=0.0, metrics={"tokens": 0.0})
    except Exception as exc:  # noqa: BLE001
        reply = failed(exc)
    ok = torch.tensor([0.0 if reply.error else 1.0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group.objects)
    if not ok.item() or not msg.tokens:  # a rank failed: no step; nothing to learn: none
        backend.optimizer.zero_grad(set_to_none=True)
        return reply
    if sharded:  # reduce-scattered in the backward passes
        reply.value = out
        return reply
    big = reduce_gradients(list(backend.params.values()), group)
    if out is not None and "grad_small_sq_norm" in out.metrics:
        out.metrics["grad_big_sq_norm"] = big
    reply.value = out
    return reply


def reduce_gradients(params: list[torch.nn.Parameter], group: Group) -> float:
    """Sum the gradients of `params` over the ranks, in float32, as one flat tensor (a rank
    whose share had no loss tokens adds zeros); returns the summed gradient's squared norm."""
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                      .detach().reshape(-1).float() for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group.gradients)
    at = 0
    for p in params:
        n = p.numel()
        p.grad = flat[at:at + n].view_as(p).to(p.dtype).clone()
        at += n
    return float(flat.dot(flat))


def weights_of(backend: Any) -> m.Weights:
    """This rank's trained weights and optimizer, on the CPU (rank 0 sends them)."""
    return m.Weights(params={k: v.detach().cpu() for k, v in backend.params.items()},
                     optimizer=backend.optimizer.state_dict(),
                     generator=backend.generator.get_state())


def _take_weights(backend: Any, msg: m.Weights) -> None:
    with torch.no_grad():
        for name, p in backend.params.items():
            p.copy_(msg.params[name].to(p.device))
    backend.optimizer.load_state_dict(msg.optimizer)
    backend.generator.set_state(msg.generator)

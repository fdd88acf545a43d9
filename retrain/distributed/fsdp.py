"""Full fine-tuning sharded over the ranks with FSDP2 (`[distributed] shard = "fsdp"`): each
rank holds 1/N of the trained weights, their gradients and AdamW's two moments.

`ShardedBackend` is a `FullBackend` that keeps two models:
- `trained`: a copy of the model put through torch's `fully_shard` (each decoder layer, then
  the root) on a one-dimensional device mesh of every rank (an explicit CPU mesh on a CPU:
  pytorch#132471). Only `forward_backward` runs it. Every forward of it is a collective (each
  layer's weights are all-gathered, and in the backward its gradients reduce-scattered), so
  every rank runs the same number of forward and backward passes: the call's micro-batches
  are counted on every rank, the largest count agreed on, and a rank with fewer runs passes
  of one pad token whose loss is 0 x logits (they add zero gradients). The layout is packed
  (one forward per micro-batch; the prefix layout's count depends on the prompts).
- `model.base`: the whole weights, a plain module that samples, computes log-probs and is
  written to checkpoints. Sampling takes different prompts, lengths and decoding steps on
  each rank, so it cannot run on sharded weights; on this copy it needs no collective, and
  rank 0 can sample alone (a batch drawn from one seed). After every optimizer step each
  rank gathers the updated weights into it (one all-gather per parameter).

So a rank holds the whole weights once plus a 1/N share of weights, gradients and AdamW
states (docs/distributed.md: memory per rank), instead of all four whole.

Gradients are summed, not averaged: each rank's loss is already divided by the whole call's
denominator, so the sum is the one-process gradient. FSDP2 averages by default, and its
divide factor is set per FSDP module (not recursively), so every module gets
`set_gradient_divide_factor(1.0)` and `set_force_sum_reduction_for_comms(True)`: a plain SUM
reduce-scatter (gloo's AVG under FSDP2 is also pytorch#162338). Clipping takes the global norm
over the sharded gradients (the same on every rank), so the non-finite skip agrees; whether
AdamW left every shard finite is agreed by an all-reduce before any rank raises.

Checkpoints are the one-process files: `save_state` runs on every rank (lead.py sends Save):
each gathers the AdamW states whole, in the one-process `optimizer.state_dict()` layout
(integer keys in parameter order), and rank 0 writes them with the whole weights it already
holds. `read_state` (rank 0, no collective) reads a checkpoint into a Weights message;
`take_state` (every rank) copies it into the whole model and slices it into this rank's
shards locally (`distribute_tensor(..., src_data_rank=None)`: no communication).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from retrain.algorithms.aggregation import Normaliser
from retrain.backends.base import (
    BackendError,
    Datum,
    LossConfig,
    LossOutput,
)
from retrain.backends.local import checkpoint
from retrain.backends.local.device import oom_as_backend_error
from retrain.backends.local.full import WEIGHTS, FullBackend
from retrain.backends.local.training import accumulate, plan
from retrain.backends.local.training.forward import Forward
from retrain.backends.local.training.logprobs import Head
from retrain.distributed import messages as m
from retrain.distributed.group import Group


def shard(full: FullBackend, group: Group) -> ShardedBackend:
    """`full` (built on every rank from the same files and seed) with its training sharded
    over `group`; `full` is not to be used after."""
    if not isinstance(full, FullBackend):
        raise BackendError("distributed.shard = 'fsdp' shards full fine-tuning only "
                           "(model.finetune = 'full')")
    sharded = ShardedBackend.__new__(ShardedBackend)
    sharded.__dict__.update(full.__dict__)
    sharded._shard(group)
    return sharded


class ShardedBackend(FullBackend):
    """FullBackend whose training state is sharded (see the module's docstring)."""

    sharded = True  # lead.py and worker.py route save/load through every rank

    def _shard(self, group: Group) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        self.group = group
        base = self.model.base
        mesh = init_device_mesh(self.model.device.type, (group.world,))
        net = copy.deepcopy(base)
        for layer in _decoder_layers(net):
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        for module in net.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        net.train()
        self.trained = net
        self.whole = dict(base.named_parameters())
        for p in self.whole.values():
            p.requires_grad_(False)  # sampled from, never trained: no autograd graphs
        self.params = dict(net.named_parameters())
        for p in self.params.values():
            p.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=1e-4)

    # ------------------------------------------------------------------ training

    def forward_backward(self, datums: list[Datum], loss: LossConfig,
                         norm: Normaliser | None = None, total_tokens: int = 0) -> LossOutput:
        """This rank's share through the sharded model, in step with every other rank (no
        halving on out-of-memory: the ranks' passes would no longer line up)."""
        with self.model.lock, oom_as_backend_error("forward_backward"):
            forward = Forward(Head(self.trained, model_forward=True), "packed",
                              self.model.cache_key, self._make_cache, self.bucket_overhead)
            units = plan.plan(datums, self.micro_batch_size, self._budget(Head(self.model.base)),
                              self.model.vocab_size, packed=True)
            mine = len(units) if any(x > 0 for d in datums for x in d.mask) else 0
            most = self._agree(mine, dist.ReduceOp.MAX)
            trainee = accumulate.Trainee(list(self.params.values()), self.model.pad_id,
                                         self.model.device, self.generator, measure=False)
            out = accumulate.forward_backward(forward, trainee, datums, loss, units, norm,
                                              total_tokens) if mine else \
                LossOutput(loss=0.0, logprobs=[[0.0] * len(d.target_tokens) for d in datums],
                           metrics={"tokens": 0.0})
            for _ in range(most - mine):
                self._idle_pass()
        self._loss_finite = self._loss_finite and math.isfinite(out.loss)
        self.token_usage.count(trained=sum(map(len, datums)))
        return out

    def _idle_pass(self) -> None:
        """A forward and backward of one pad token that adds nothing to any gradient."""
        ids = torch.full((1, 1), self.model.pad_id, dtype=torch.long, device=self.model.device)
        logits = self.trained(input_ids=ids, use_cache=False).logits
        (logits.float().sum() * 0.0).backward()

    def _agree(self, value: int, op: Any) -> int:
        """`op` (MIN, MAX) of `value` over the ranks, on the message group (gloo, CPU)."""
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=op, group=self.group.objects)
        return int(t.item())

    def _clip(self, params: list[Any], clip: float) -> float:
        """The global norm (clip_grad_norm_ over the shards gives a DTensor), the same on
        every rank, so the non-finite skip agrees."""
        from torch.distributed.tensor import DTensor

        total = torch.nn.utils.clip_grad_norm_(params, clip)
        return float(total.full_tensor() if isinstance(total, DTensor) else total)

    def _finite(self, params: list[Any]) -> bool:
        """Every rank's shards finite: all undo the update, or none."""
        finite = checkpoint.all_finite(p.to_local() for p in params)
        return bool(self._agree(int(finite), dist.ReduceOp.MIN))

    def _stepped(self) -> None:
        self._gather_whole()  # the whole weights the sampler reads

    def _gather_whole(self) -> None:
        """The sharded weights, all-gathered into the whole model (every rank, in order)."""
        with torch.no_grad():
            for name, p in self.params.items():
                self.whole[name].copy_(p.full_tensor())

    # ------------------------------------------------------------------ checkpoints

    def save_state(self, name: str) -> str:
        """Every rank: gather the AdamW states whole; rank 0 writes the one-process folder
        and returns it (the other ranks have no run folder: they return "")."""
        state = _Whole(self._whole_optimizer_state())
        if not self.group.leader:
            return ""
        if self.checkpoint_dir is None:
            raise BackendError("save_state needs checkpoint_dir (set by the trainer)")
        return checkpoint.write(self.checkpoint_dir / name, self.model, self.whole.values(),
                                self._write_weights, state, self.generator, what="model")

    def _saved_weights(self) -> dict[str, Any]:
        return self.whole  # gathered after every step: what one process would write

    def _whole_optimizer_state(self) -> dict[str, Any]:
        """`optimizer.state_dict()` with every sharded tensor gathered whole onto the CPU
        (a collective per tensor, in the same order on every rank)."""
        from torch.distributed.tensor import DTensor

        sd = self.optimizer.state_dict()
        state = {}
        for i in sorted(sd["state"]):
            st = sd["state"][i]
            state[i] = {k: (st[k].full_tensor().cpu() if isinstance(st[k], DTensor) else st[k])
                        for k in sorted(st)}
        return {"state": state, "param_groups": sd["param_groups"]}

    def read_state(self, ref: str) -> m.Weights:
        """Rank 0: a checkpoint read into a Weights message of whole tensors (no collective);
        a missing or damaged one is a BackendError, raised before any rank changes."""
        got: dict[str, Any] = {}

        def load_weights(folder: Path) -> None:
            weights = checkpoint.finite_weights(folder / WEIGHTS, torch.device("cpu"))
            missing = sorted(set(self.whole) - set(weights))
            extra = sorted(set(weights) - set(self.whole))
            if missing or extra:
                raise BackendError(f"checkpoint {folder} does not match the model: missing "
                                   f"{missing[:3]}, unexpected {extra[:3]}")
            got.update(weights)

        optimizer, generator = _Whole(), torch.Generator(self.model.device)
        checkpoint.read(ref, self.checkpoint_dir, WEIGHTS, self.model, load_weights, optimizer,
                        generator)
        return m.Weights(params=got, optimizer=optimizer.sd, generator=generator.get_state())

    def take_state(self, msg: m.Weights) -> None:
        """Every rank: the whole state of `msg` into the whole model, this rank's shards of it
        into the sharded model and AdamW (sliced locally), and the generator."""
        with self.model.lock, torch.no_grad():
            for name, p in self.whole.items():
                p.copy_(msg.params[name].to(p.device))
            for name, p in self.params.items():
                p.copy_(_shard_like(msg.params[name], p))
            order = list(self.params.values())
            state = {i: {k: (_shard_like(v, order[i]) if _whole_like(v, order[i]) else v)
                         for k, v in st.items()} for i, st in msg.optimizer["state"].items()}
            self.optimizer.load_state_dict({"state": state,
                                            "param_groups": msg.optimizer["param_groups"]})
            self.optimizer.zero_grad(set_to_none=True)
            self.generator.set_state(msg.generator)

    def load_state(self, ref: str) -> None:
        """This rank alone reads `ref` and takes it (no collective)."""
        self.take_state(self.read_state(ref))


class _Whole:
    """An optimizer's state dict standing in for the optimizer that checkpoint.write saves
    and checkpoint.read loads."""

    def __init__(self, sd: dict[str, Any] | None = None):
        self.sd = sd or {}

    def state_dict(self) -> dict[str, Any]:
        return self.sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sd = sd

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def _decoder_layers(net: Any) -> list[Any]:
    """The decoder layers of a transformers causal LM (each its own FSDP unit), or none."""
    body = net.get_decoder() if hasattr(net, "get_decoder") else None
    layers = getattr(body, "layers", None)
    return list(layers) if layers is not None else []


def _whole_like(value: Any, param: Any) -> bool:
    return isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(param.shape) \
        and value.dim() > 0


def _shard_like(whole: torch.Tensor, param: Any) -> Any:
    """This rank's shard of `whole`, placed as `param` (a DTensor) is: sliced locally."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole.to(device=param.device, dtype=param.dtype),
                             param.device_mesh, param.placements, src_data_rank=None)

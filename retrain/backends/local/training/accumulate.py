"""The training pass of one forward_backward call: every micro-batch's forward, loss and
backward, the gradient accumulating in the parameters.

The loss is normalised over the whole call (algorithms/aggregation.py): each micro-batch adds
`sum(weight x token loss) / the call's denominator`. Nothing is read back to the host per
micro-batch: the loss, KL and ratio statistics and the gradient diagnostics sum on the
device, the log-probs are gathered there, and the host reads all of it once, at the end (a
read per micro-batch would make the host wait for the device every time, as `float(loss)`
and `.tolist()` did). All micro-batches are packed before the first forward, so the host's
packing is done before the device starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from retrain.algorithms import aggregation
from retrain.algorithms.kl import token_kl
from retrain.backends.base import Datum, LossConfig, LossOutput
from retrain.backends.local.training import policy_losses
from retrain.backends.local.training.diagnostics import GradDiagnostics
from retrain.backends.local.training.forward import Forward
from retrain.backends.local.training.plan import Unit


@contextmanager
def seeded_dropout(generator: torch.Generator, device: torch.device) -> Iterator[None]:
    """LoRA dropout draws from the global RNG: seed it from the backend's own generator
    (saved with checkpoints) so that training resumes exactly, and restore it afterwards."""
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=device))
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


@dataclass
class Trainee:
    """What the pass needs of the backend: the trained parameters, the pad id, the device and
    the generator LoRA dropout is seeded from. `measure` False: no micro-batch gradient
    diagnostics (sharded parameters: each micro-batch's gradient is summed over the ranks as
    it is reduce-scattered, so no rank sees its own)."""

    params: list[torch.nn.Parameter]
    pad_id: int
    device: torch.device
    generator: torch.Generator
    measure: bool = True


def forward_backward(forward: Forward, trainee: Trainee, datums: list[Datum],
                     loss: LossConfig, units: list[Unit],
                     norm: aggregation.Normaliser | None = None, whole_tokens: int = 0
                     ) -> LossOutput:
    """Accumulate the gradient of `loss` over `datums`, micro-batch by micro-batch. `norm`
    and `whole_tokens`: `datums` are one rank's share of a call (retrain/distributed), with
    their weights in the whole call's normaliser and the call's loss tokens."""
    tokens = [sum(1 for m in d.mask if m > 0) for d in datums]
    total_tokens = sum(tokens)
    out_lp: list[list[float]] = [[0.0] * len(d.target_tokens) for d in datums]
    if total_tokens == 0:
        return LossOutput(loss=0.0, logprobs=out_lp, metrics={"tokens": 0.0})
    norm = norm or aggregation.normaliser(tokens, loss.aggregation, loss.max_tokens)
    dev = trainee.device
    batches = [forward.pack(datums, unit, trainee.pad_id, dev, norm.weights,
                            with_ref=bool(loss.kl_coef)) for unit in units]
    grads = GradDiagnostics(trainee.params, whole_tokens or total_tokens,
                            len(units) if trainee.measure else 0)
    loss_sum, kl_sum = torch.zeros((), device=dev), torch.zeros((), device=dev)
    ratios, lps, diagnostics_s = policy_losses.RatioStats(), [], 0.0
    with seeded_dropout(trainee.generator, dev):
        for batch in batches:
            t = batch.t
            lp = forward.logprobs(batch, loss.temperature)
            terms = policy_losses.token_losses(lp, t.old_logprobs, t.advantages, loss, t.seq,
                                               t.in_ratio, t.sequences)
            per_tok = terms.loss
            if loss.kl_coef:
                kl = token_kl(lp, t.ref_logprobs, loss.kl_estimator)
                per_tok = per_tok + loss.kl_coef * kl
                kl_sum = kl_sum + kl.detach().sum()
            chunk_loss = (per_tok * t.weights).sum() / norm.denominator
            chunk_loss.backward()
            diagnostics_s += _timed(grads.after_micro_batch, int(t.tokens.numel()))
            loss_sum = loss_sum + chunk_loss.detach()
            ratios.add(terms)
            lps.append(lp.detach())
    write_logprobs(out_lp, [w for b in batches for w in b.t.where], lps)
    loss_value, kl_value = torch.stack([loss_sum, kl_sum]).tolist()
    metrics = {"tokens": float(total_tokens), **grads.metrics(),
               "grad_diagnostics_s": diagnostics_s, **ratios.metrics()}
    if loss.kl_coef:
        metrics["kl"] = kl_value / total_tokens
    return LossOutput(loss=loss_value, logprobs=out_lp, metrics=metrics)


def write_logprobs(out: list[list[float]], where: list[tuple[int, int]],
                   parts: list[torch.Tensor]) -> None:
    """out[i][pos] = each value of `parts` (concatenated) at its (i, pos): one host read."""
    if not parts:
        return
    for (i, pos), value in zip(where, torch.cat(parts).cpu().tolist(), strict=True):
        out[i][pos] = value


def _timed(fn, *args) -> float:
    import time

    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0

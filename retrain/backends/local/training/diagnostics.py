"""Each micro-batch's own gradient, for the gradient noise scale and coherence (seed 003).

A micro-batch adds `sum(loss) / total tokens` to the accumulated gradient, so its own
token-mean gradient is that increment x total / its tokens. The sums stay on the device; the
host reads them once, in `metrics`, after the call's last micro-batch.
"""

from __future__ import annotations

import torch


class GradDiagnostics:
    """The micro-batches' gradients on `params`, compared as they accumulate."""

    def __init__(self, params: list[torch.nn.Parameter], total_tokens: int,
                 micro_batches: int = 2):
        """`micro_batches` < 2: there is nothing to compare, so no flat copy of the gradient
        is made (with full fine-tuning each is as large as the model); only the count is
        reported, as always for one micro-batch (0: none measured, whatever the count)."""
        self.params, self.total_tokens = params, total_tokens
        self.active = micro_batches >= 2
        self.start = self.previous = self._accumulated() if self.active else torch.zeros(0)
        self.sq_norms: list[torch.Tensor] = []
        self.tokens: list[int] = []
        self.cosines: list[torch.Tensor] = []
        self.last: torch.Tensor | None = None

    def _accumulated(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                          .detach().reshape(-1).float() for p in self.params])

    def after_micro_batch(self, tokens: int) -> None:
        self.tokens.append(tokens)
        if not self.active:
            return
        now = self._accumulated()
        g = (now - self.previous) * (self.total_tokens / tokens)
        self.previous = now
        self.sq_norms.append(g.dot(g))
        if self.last is not None:
            self.cosines.append(torch.nn.functional.cosine_similarity(g, self.last, dim=0))
        self.last = g

    def metrics(self) -> dict[str, float]:
        """Raw measurements for control.gradnoise.GradStats (only the count with one batch)."""
        k = len(self.tokens)
        if k < 2 or not self.active:
            return {"grad_micro_batches": float(k)}
        whole = self.previous - self.start
        read = torch.stack([torch.stack(self.sq_norms).sum(), whole.dot(whole),
                            torch.stack(self.cosines).sum()]).tolist()
        return {"grad_micro_batches": float(k),
                "grad_small_sq_norm": read[0] / k,
                "grad_small_tokens": k / sum(1.0 / t for t in self.tokens),
                "grad_big_sq_norm": read[1],
                "grad_big_tokens": float(sum(self.tokens)),
                "grad_coherence": read[2] / len(self.cosines)}

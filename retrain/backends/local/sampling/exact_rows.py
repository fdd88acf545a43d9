"""The exact sampler's host side: each completion's tokens, log-probs, finish and top
log-probs (`Rows`), and the decoding steps drawn on the device since the last host read
(`Window`).

A window of one step is the step-by-step loop: every token is read as it is drawn. A longer
one (`sampler_mode.EXACT_WINDOW`, on CUDA) lets the device run ahead: the steps are read back
at once and walked in step order, exactly as the one-step loop would have recorded them (the
same `on_token` calls in the same order, the same DivergedError before any token of the step
that was not finite). A row's tokens after the one that ended it are dropped: it was decoded
on for nothing until the read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from retrain.backends.base import Completion, DivergedError
from retrain.backends.stop_strings import StopWatch

# (completion index, token, its log-prob, the top (token, log-prob) pairs or None)
OnToken = Callable[[int, int, float, list[tuple[int, float]] | None], None]


@dataclass
class Rows:
    """The completions being decoded: token and log-prob lists, indexed by completion."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finished: list[bool]
    top: list[list[list[tuple[int, float]]]] | None = None  # per row, per position

    @classmethod
    def empty(cls, total: int, keep_top: bool) -> Rows:
        return cls([[] for _ in range(total)], [[] for _ in range(total)], [False] * total,
                   [[] for _ in range(total)] if keep_top else None)

    def completions(self, n: int, n_prompts: int) -> list[list[Completion]]:
        """The rows as Completions, grouped by prompt."""
        flat = [Completion(tokens=t, logprobs=lp, finish_reason="stop" if f else "length",
                           top_logprobs=self.top[i] if self.top is not None else None)
                for i, (t, lp, f) in enumerate(zip(self.tokens, self.logprobs, self.finished,
                                                   strict=True))]
        return [flat[i * n:(i + 1) * n] for i in range(n_prompts)]


class Window:
    """Steps drawn on the device and not read yet: per step, each batch row's token, its
    log-prob, whether its distribution was finite, and its top `top_k` (token, log-prob)."""

    def __init__(self, top_k: int):
        self.top_k = top_k
        self._clear()

    def _clear(self) -> None:
        self._tok: list[torch.Tensor] = []
        self._lp: list[torch.Tensor] = []
        self._bad: list[torch.Tensor] = []
        self._top: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self._tok)

    def add(self, lp: torch.Tensor, tok: torch.Tensor) -> None:
        """One step: `lp` [rows, vocab] the distribution drawn from, `tok` [rows] the draws."""
        self._bad.append(~torch.isfinite(lp.amax(dim=-1)))
        self._tok.append(tok)
        self._lp.append(lp.gather(-1, tok[:, None]).squeeze(-1))
        if self.top_k > 0:
            values, ids = lp.topk(min(self.top_k, lp.shape[-1]), dim=-1)
            self._top.append((ids, values))

    def read(self, rows: Rows, active: list[int], ends: set[int], watch: StopWatch,
             on_token: OnToken | None) -> list[bool]:
        """Record the window's steps for the completions `active` (batch row i decodes
        completion active[i]) and empty it; per batch row, whether it ended (an end token,
        a stop string)."""
        toks = torch.stack(self._tok, 1).tolist()
        lps = torch.stack(self._lp, 1).tolist()
        bad = torch.stack(self._bad, 1).tolist()
        tops = [(ids.tolist(), values.tolist()) for ids, values in self._top]
        steps = len(self._tok)
        self._clear()
        ended = [False] * len(active)
        live = list(range(len(active)))
        for j in range(steps):
            if any(bad[i][j] for i in live):
                raise DivergedError("sampling: the next-token probabilities are not finite "
                                    "(NaN or infinite logits): the weights diverged",
                                    sampling=True)
            for i in live:
                top = list(zip(tops[j][0][i], tops[j][1][i], strict=True)) if tops else None
                ended[i] = _take(rows, active[i], toks[i][j], lps[i][j], top, ends, watch,
                                 on_token)
            live = [i for i in live if not ended[i]]
            if not live:
                break
        return ended


def _take(rows: Rows, row: int, tok: int, lp: float, top: list | None, ends: set[int],
          watch: StopWatch, on_token: OnToken | None) -> bool:
    """Record one token of completion `row`; True when it ends the completion."""
    rows.tokens[row].append(tok)
    rows.logprobs[row].append(lp)
    if rows.top is not None:
        rows.top[row].append(top)
    if on_token is not None:
        on_token(row, tok, lp, top)
    done = tok in ends or bool(watch and watch.hit(rows.tokens[row]))
    rows.finished[row] = done
    return done

"""The fast sampler's host side: each completion's tokens, log-probs and finish, and which live
completion sits in which slot of the static state.

Every `check_every` steps the sampler reads the steps drawn since the last read ([slots,
steps] tokens and log-probs) and `Rows.collect` takes them: per live row, the tokens up to and
including the first end token (EOS, a stop token), cut at the row's own length limit. It
works row by row, not token by token: one set test finds the rows that hold an end token at
all, and a row's tokens are appended as one slice. Stop strings need the decoded text: rows
are then walked token by token, as the exact sampler does. The GPU waits while the host
reads, so this is device time too.
"""

from __future__ import annotations

import math

import torch

from retrain.backends.base import Completion, DivergedError
from retrain.backends.stop_strings import StopWatch


class Rows:
    """Host side of a decode. `limits`: each completion's most tokens (None: no own limit,
    the decode's max_tokens ends it)."""

    def __init__(self, total: int, ends: set[int], watch: StopWatch,
                 limits: list[int] | None = None):
        self.tokens: list[list[int]] = [[] for _ in range(total)]
        self.logprobs: list[list[float]] = [[] for _ in range(total)]
        self.stopped = [False] * total
        self.live = [(row, row) for row in range(total)]  # (slot, completion) still going
        self.ends, self.watch = ends, watch
        self.limits = limits

    def collect(self, toks: torch.Tensor, lps: torch.Tensor) -> None:
        """Take the steps just drawn: `toks`, `lps` [slots, steps] (any device: one read);
        rows that ended leave `live`. A non-finite log-prob among the kept tokens is a
        DivergedError."""
        if not self.live:
            return
        toks_l = toks.cpu().numpy().tolist()  # numpy's tolist: ~4x torch's for int64
        lps_l = lps.float().cpu().numpy().tolist()
        going = []
        for slot, row in self.live:
            t, lp = toks_l[slot], lps_l[slot]
            cut, ended = self._cut(row, t)
            if not all(map(math.isfinite, lp[:cut])):
                raise DivergedError("sampling: the next-token probabilities are not finite "
                                    "(NaN or infinite logits): the weights diverged",
                                    sampling=True)
            self.tokens[row] += t[:cut]
            self.logprobs[row] += lp[:cut]
            self.stopped[row] = ended
            if not (ended or self._at_limit(row)):
                going.append((slot, row))
        self.live = going

    def _cut(self, row: int, toks: list[int]) -> tuple[int, bool]:
        """How many of `toks` row `row` keeps, and whether an end token or a stop string
        (not its length limit) ended it there."""
        cut = len(toks)
        if self.limits is not None:
            cut = min(cut, self.limits[row] - len(self.tokens[row]))
        ended = not self.ends.isdisjoint(toks[:cut])  # C-speed; most rows hold no end
        if ended:
            cut = next(i for i, t in enumerate(toks) if t in self.ends) + 1
        if self.watch:
            return self._watch_cut(row, toks, cut, ended)
        return cut, ended

    def _watch_cut(self, row: int, toks: list[int], cut: int, ended: bool) -> tuple[int, bool]:
        """The cut moved up to the first token that completes a stop string, if any."""
        text = list(self.tokens[row])
        for i, t in enumerate(toks[:cut]):
            text.append(t)
            if self.watch.hit(text):
                return i + 1, True
        return cut, ended

    def _at_limit(self, row: int) -> bool:
        return self.limits is not None and len(self.tokens[row]) >= self.limits[row]

    def moved(self) -> torch.Tensor:
        """The live rows' slots, which now become slots 0, 1, ... (a compaction)."""
        slots = [slot for slot, _ in self.live]
        self.live = [(i, row) for i, (_, row) in enumerate(self.live)]
        return torch.tensor(slots, dtype=torch.long)

    def completions(self, n: int) -> list[list[Completion]]:
        flat = [Completion(tokens=t, logprobs=lp, finish_reason="stop" if s else "length")
                for t, lp, s in zip(self.tokens, self.logprobs, self.stopped, strict=True)]
        return [flat[i:i + n] for i in range(0, len(flat), n)]

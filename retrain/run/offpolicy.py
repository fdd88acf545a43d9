"""Off-policy overlap (`training.max_steps_off_policy = 1`): the next step samples while
this step trains.

With a remote backend every call waits a round trip, so an on-policy loop (sample, then
train, then sample again) leaves both sides idle for much of each step. With overlap, the
trainer starts sampling step k+1's batch right before it trains step k, on the sampler of
the weights that step k starts from; step k+1 then trains on completions one optimizer
update old (`sample_staleness = 1`). The losses need no change: their importance ratio is
taken against the log-probs the sampler reported, so the correction for staleness is exact.

Exact resume: the checkpoint of step k waits for step k+1's batch and saves it (prompt
indices, completions, the data cursor around it) to `prefetch/step-<k+1>.json` next to
state.json; a resumed run trains exactly that batch at step k+1, so it repeats what an
uninterrupted run does. `state.json`'s data cursor keeps its on-policy meaning (prompts of
committed steps only): if the batch file is lost, the resumed run samples step k+1 afresh
on the checkpoint's weights (deterministic, but not the uninterrupted run's batch).
The trainer also lets step k's checkpoint land during step k+1 (docs/training.md).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrain.backends.base import Backend, Completion, SamplingParams, TokenIds
from retrain.runfiles import runlog

FOLDER = "prefetch"
EXTRA_KEY = "prefetched_batch"  # state.json `extra`: the batch file saved with the checkpoint


@dataclass
class Batch:
    """One step's prompts and completions, sampled ahead of the step that trains them."""

    step: int
    index: list[int]                  # prompt indices into the train split
    groups: list[list[Completion]]
    cursor_before: dict               # data cursor before these prompts were taken
    cursor_after: dict
    version: int                      # optimizer updates applied when sampling started
    staleness: int | None = None      # set once known (at checkpoint, or when trained)


class Overlap:
    """The trainer's side of the overlap; every method is a no-op when it is off."""

    def __init__(self, backend: Backend, run_dir: Path, enabled: bool):
        self.backend = backend
        self.folder = Path(run_dir) / FOLDER
        self.enabled = enabled
        self.version = 0          # optimizer updates so far (only differences matter)
        self._batch: Batch | None = None
        self._job: Any = None     # the sampling in flight for self._batch

    def updated(self) -> None:
        """The trainer applied an optimizer update."""
        self.version += 1

    def planned_batch_size(self, step: int, default: int) -> int:
        """The batch size of `step`: fixed when its batch was sampled ahead."""
        batch = self._batch
        return len(batch.index) if batch is not None and batch.step == step else default

    def start(self, step: int, index: list[int], prompts: list[TokenIds], n: int,
              params: SamplingParams, cursor_before: dict, cursor_after: dict) -> None:
        """Submit `step`'s sampling now, on the weights as they are; returns at once."""
        self._batch = Batch(step, list(index), [], cursor_before, cursor_after, self.version)
        self._job = self.backend.sample_async(prompts, n, params)

    def take(self, step: int) -> Batch | None:
        """`step`'s batch if it was sampled ahead (waits for it), else None."""
        batch = self._ready(step)
        if batch is None:
            self.discard()  # nothing, or a batch for another step (after an OOM retry)
        self._batch = None
        if batch is not None and batch.staleness is None:
            batch.staleness = self.version - batch.version
        return batch

    def discard(self) -> None:
        """Drop the batch in flight (the step it was for will sample afresh)."""
        if self._job is not None:
            self._job.cancel()
        self._batch, self._job = None, None

    def _ready(self, step: int) -> Batch | None:
        batch = self._batch
        if batch is None or batch.step != step:
            return None
        if self._job is not None:
            batch.groups, self._job = self._job.result(), None
        return batch

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self, step: int, state: runlog.RunState) -> None:
        """With step `step`'s checkpoint: save the batch sampled for step + 1, keep the
        data cursor of the committed steps in state.json, prune older batch files."""
        state.extra.pop(EXTRA_KEY, None)
        batch = self._ready(step + 1)
        if batch is None:
            return
        batch.staleness = self.version - batch.version
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"step-{batch.step:06d}.json"
        runlog.write_json_atomic(path, _to_json(batch))
        state.data_cursor = batch.cursor_before
        state.extra[EXTRA_KEY] = f"{FOLDER}/{path.name}"
        for old in sorted(self.folder.glob("step-*.json"))[:-2]:  # this one and the previous
            old.unlink(missing_ok=True)

    def restore(self, state: runlog.RunState, n_train: int, vocab: int) -> str:
        """On resume: load the batch saved with the checkpoint, if any. A missing, torn or
        damaged one (prompt indices outside the `n_train` problems, token ids outside the
        `vocab`) is dropped: the step samples afresh. Returns a one-line note then, else ''."""
        name = state.extra.get(EXTRA_KEY)
        if not self.enabled or not name:
            return ""
        step = state.step + 1
        raw = runlog.read_json(self.folder.parent / str(name))
        why = "is missing or unreadable (torn)" if raw is None else \
            batch_problem(raw, step, n_train, vocab)
        if why:
            return (f"the batch sampled ahead for step {step} ({name}) {why}; sampling step "
                    f"{step} afresh (the same weights, not the uninterrupted run's draws)")
        self._batch, self._job = _from_json(raw), None
        return ""


def batch_problem(raw: dict, step: int, n_train: int, vocab: int) -> str:
    """Why a saved batch cannot be trained at `step` ('' when it can)."""
    if raw.get("step") != step:
        return f"is for step {raw.get('step')!r}"
    index, groups = raw.get("index"), raw.get("groups")
    if not isinstance(index, list) or not index or \
            not all(_count(i) and i < n_train for i in index):
        return f"holds prompt indices outside 0..{n_train - 1}"
    if not isinstance(groups, list) or len(groups) != len(index):
        return "holds a different number of groups than prompts"
    for c in (c for g in groups for c in (g if isinstance(g, list) and g else [None])):
        if not isinstance(c, dict):
            return "holds an empty or malformed group"
        tokens, logprobs = c.get("tokens"), c.get("logprobs")
        if not isinstance(tokens, list) or not all(_count(t) and t < vocab for t in tokens):
            return f"holds token ids outside the vocabulary (0..{vocab - 1})"
        if not isinstance(logprobs, list) or len(logprobs) != len(tokens) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                for x in logprobs):
            return "holds log-probs that are not one finite number per token"
        if c.get("finish_reason") not in ("stop", "length"):
            return "holds an unknown finish_reason"
    for key in ("cursor_before", "cursor_after"):
        cursor = raw.get(key)
        if not (isinstance(cursor, dict) and cursor.get("n_items") == n_train
                and _count(cursor.get("epoch")) and _count(cursor.get("position"))
                and cursor["position"] <= n_train):
            return f"holds a damaged {key}"
    if not _count(raw.get("staleness")):
        return "holds a damaged staleness"
    return ""


def _count(value: object) -> bool:
    """A non-negative int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _to_json(batch: Batch) -> dict:
    out = dataclasses.asdict(batch)
    out["saved_at"] = time.time()
    return out


def _from_json(raw: dict) -> Batch:
    groups = [[Completion(list(c["tokens"]), list(c["logprobs"]), c["finish_reason"])
               for c in group] for group in raw["groups"]]
    return Batch(step=raw["step"], index=list(raw["index"]), groups=groups,
                 cursor_before=raw["cursor_before"], cursor_after=raw["cursor_after"],
                 version=0, staleness=raw["staleness"])

"""What a run fixes when it starts, kept in its resume points: its [sft] step count, and a
content digest of every data source it reads ([data], its held-out split included, and
[sft.data]).

The step count is not derived again from the data's rows at a later launch, so the RL steps
(and their learning-rate schedule) never shift.

A resume whose data changed is refused, naming the source and `--new`: steps 1..k on one
dataset and k+1.. on another is not one experiment. A finished SFT stage's data is not read
again (run/single.py), so it is not checked either: what it trained on is done.

The digest is taken over the rows as loaded (prompt, answer, messages), so it covers a JSONL
file, a Hugging Face dataset (read as its files are now: environments/hf_files.py) and a
generated task alike, and a change that leaves the row count alone is caught too. Runs from
before digests carry none: nothing to compare, and they gain one on their next launch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrain.errors import UserError
from retrain.runfiles import runlog

DIGESTS = "data_digests"   # the state.extra key: {source key: DataDigest.record()}
SFT_STEPS = "sft_steps"    # the state.extra key: the run's [sft] steps


@dataclass(frozen=True)
class DataDigest:
    """One data source as a run read it: its config key, where it came from, rows, sha256."""

    key: str        # the config section it is set in: "data" or "sft.data"
    where: str      # a file, a dataset folder, or the built-in task
    rows: int
    sha256: str

    def record(self) -> dict:
        return {"where": self.where, "rows": self.rows, "sha256": self.sha256}


def digest(key: str, where: str, rows: list[Any]) -> DataDigest:
    """The digest of `rows` (dataclasses or JSON-like values), in order."""
    h = hashlib.sha256()
    for row in rows:
        value = dataclasses.asdict(row) if dataclasses.is_dataclass(row) else row
        h.update(json.dumps(value, sort_keys=True, default=str).encode("utf-8"))
        h.update(b"\n")
    return DataDigest(key, where, len(rows), h.hexdigest())


@dataclass
class RunFacts:
    """What this launch hands the stages to record in every resume point they write."""

    sft_steps: int
    digests: list[DataDigest]

    def stamp(self, state: runlog.RunState) -> None:
        state.extra[SFT_STEPS] = self.sft_steps  # campaigns read it too (run_records)
        stamp(state, self.digests)


def stamp(state: runlog.RunState, digests: list[DataDigest]) -> None:
    """Record `digests` in `state` (the sources read now; others recorded earlier stay)."""
    saved = state.extra.get(DIGESTS)
    recorded = dict(saved) if isinstance(saved, dict) else {}
    recorded.update({d.key: d.record() for d in digests})
    state.extra[DIGESTS] = recorded


def check_unchanged(run_dir: Path, state: runlog.RunState, digests: list[DataDigest]) -> None:
    """A UserError when a source recorded in `state` now reads differently."""
    saved = state.extra.get(DIGESTS)
    if not isinstance(saved, dict):
        return
    for now in digests:
        then = saved.get(now.key)
        if not isinstance(then, dict) or then.get("sha256") == now.sha256:
            continue
        rows = f"{then.get('rows')} rows then, {now.rows} now" if then.get("rows") != now.rows \
            else f"the same {now.rows} rows, different content"
        raise UserError(f"{run_dir} was trained on {now.key} = {then.get('where', now.where)}, "
                        f"which has changed since ({rows}); resuming would train one run on "
                        f"two datasets. Restore {now.where}, or start over with --new (moves "
                        "this folder aside)")

"""manifest.json: the campaign plan and each run's status, always written atomically.

Schema: see the campaign section of docs/campaigns.md. Readers (status, resume) get
defaults for missing keys, so an older manifest never breaks them.
"""

from __future__ import annotations

import dataclasses
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrain.errors import UserError
from retrain.runfiles import runlog, safejson

# skipped: a run a race did not need (docs/campaigns.md, "Racing"); it never started.
RUN_STATUSES = ("pending", "running", "completed", "failed", "interrupted", "skipped",
                "budget")
CAMPAIGN_STATUSES = ("running", "completed", "failed", "interrupted", "budget")
# The campaign folder: <campaign>/slots/ holds the API semaphore; <campaign>/<run>/worker.log
# is each worker's output.
SLOTS_DIR = "slots"
WORKER_LOG = "worker.log"


@dataclass
class RunEntry:
    """One run's line in the manifest. `failures` counts failed attempts (for max_retries)."""

    name: str
    condition: str
    seed: int
    overrides: dict[str, Any] = field(default_factory=dict)
    status: str = "pending"
    attempts: int = 0
    failures: int = 0
    exit_code: int | None = None
    pid: int = 0
    started_at: float | None = None
    ended_at: float | None = None
    log_dir: str = ""
    last_step: int = 0
    max_steps: int = 0
    final_metrics: dict[str, Any] = field(default_factory=dict)
    error: str = ""   # last lines of worker.log when the run failed
    host: str = ""    # where the current (or last) attempt runs; Ray executor only
    node: str = ""
    placements: list[dict[str, Any]] = field(default_factory=list)  # {attempt, host, node, pid}
    spent: dict[str, float] = field(default_factory=dict)  # its bill's Tally, at the end


@dataclass
class Manifest:
    """The whole manifest.json."""

    campaign: str
    config_file: str
    config_hash: str
    created_at: float = field(default_factory=time.time)
    updated_at: float = 0.0
    runner: dict[str, Any] = field(default_factory=dict)
    status: str = "running"
    parallel: bool = False
    max_workers: int = 0
    stagger_seconds: float = 0.0
    max_concurrent: int = 1
    slots_dir: str = SLOTS_DIR
    executor: str = "local"
    slots_actor: str = ""   # the Ray slot actor's name (executor = "ray")
    ray_address: str = ""
    conditions: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    runs: list[RunEntry] = field(default_factory=list)
    retired_runs: list[RunEntry] = field(default_factory=list)  # left the matrix under --force
    race: dict[str, Any] = field(default_factory=dict)  # [campaign.race]: plan, state, runs

    def entry(self, name: str) -> RunEntry | None:
        return next((r for r in self.runs if r.name == name), None)

    def counts(self) -> dict[str, int]:
        """How many runs are in each status."""
        out = dict.fromkeys(RUN_STATUSES, 0)
        for r in self.runs:
            out[r.status] = out.get(r.status, 0) + 1
        return out

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Manifest:
        """Values of the wrong type (a hand-edited or foreign file) fall back to defaults."""
        known = _typed(cls, d, {"campaign": "", "config_file": "", "config_hash": ""},
                       skip=("runs", "retired_runs"))
        if known.get("status", "running") not in CAMPAIGN_STATUSES:
            del known["status"]
        for key in ("runs", "retired_runs"):
            value = d.get(key)
            known[key] = [_entry(r) for r in value if isinstance(r, dict)] \
                if isinstance(value, list) else []
        return cls(**known)


def _entry(d: dict) -> RunEntry:
    known = _typed(RunEntry, d, {"name": "?", "condition": "", "seed": 0})
    if known.get("status", "pending") not in RUN_STATUSES:
        del known["status"]
    return RunEntry(**known)


def _typed(cls: type, d: dict, required: dict[str, Any], skip: tuple = ()) -> dict:
    """The keys of `d` that `cls` has and whose values have the declared type; `required`
    supplies fields without a default."""
    hints = typing.get_type_hints(cls)
    out = dict(required)
    for name in cls.__dataclass_fields__:
        # plain int fields are counts, pids, steps, seeds: never negative (unlike exit_code)
        negative = hints[name] is int and isinstance(d.get(name), int) and d[name] < 0
        if name in d and name not in skip and _fits(d[name], hints[name]) and not negative:
            out[name] = d[name]
    return out


def _fits(value: Any, tp: Any) -> bool:
    """Whether `value` has type `tp` (int | None, list[int], dict[str, Any], float, ...)."""
    if isinstance(value, bool) and tp is not bool:
        return False
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float))
    if origin is list:
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, tp) if isinstance(tp, type) else True


def manifest_path(campaign_dir: str | Path) -> Path:
    return Path(campaign_dir) / runlog.MANIFEST_FILE


def save_manifest(campaign_dir: str | Path, manifest: Manifest) -> None:
    """Atomically replace manifest.json (readers see the old or the new file, never half)."""
    manifest.updated_at = time.time()
    runlog.write_json_atomic(manifest_path(campaign_dir), manifest.to_dict())


def load_manifest(campaign_dir: str | Path) -> Manifest | None:
    """The campaign's manifest, None when there is none; UserError when it is unreadable."""
    path = manifest_path(campaign_dir)
    if not path.exists():
        return None
    try:
        data = safejson.read_object(path)
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UserError(f"{path}: not a readable manifest ({why}); the run folders beside it "
                        "are intact. Move it aside, or start a fresh campaign with --new"
                        ) from None
    return Manifest.from_dict(data)

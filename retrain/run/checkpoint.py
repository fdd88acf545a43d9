"""The run folder as a resume point: what to do with an existing folder, checkpoint retention.

Resume rules (single runs):
- no folder, or nothing trained yet: a fresh run;
- the resume point is the newest of state.json and the checkpoints' own resume points
  (`checkpoints/step-N.json`, a copy of state.json written right after checkpoint N): so a
  missing, torn, hostile or hand-broken state.json never makes a run start over; when no
  sound resume point is left but the folder holds metrics or checkpoints, it is an error
  (nothing is touched) that offers `--new`. A checkpoint that fails to load falls back to
  the previous one (trainer);
- status completed and `max_steps` not raised: nothing to do (exit 0);
- a live process already running it: refuse;
- otherwise resume after the last checkpointed step, provided the config did not change in
  a key that alters the training (keys in `RESUMABLE_CHANGES` may change);
- `--new`: the old folder is moved aside to `<run>.prev-<timestamp>` (never deleted).

A run only ever uses its own checkpoints: records name them relative to the run folder
(`checkpoints/step-000012`), older records are read by the checkpoint's name
(runlog.own_checkpoint), so a moved, archived or copied folder never resumes from another's.

Checkpoints: the trainer saves one after EVERY step (a LoRA adapter + optimizer is small), so
a kill loses at most the step in flight. `prune` keeps the newest, every `save_every`-th and
the final one; the rest are deleted once a newer checkpoint is committed in state.json.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from retrain.backends.base import BackendError
from retrain.config.loader import diff, loads_config
from retrain.config.sections import Config, ConfigError, to_dict
from retrain.errors import UserError
from retrain.run import run_facts
from retrain.run.run_facts import DataDigest
from retrain.runfiles import runlog

# Keys that may differ between the first launch and a resume without changing the math (a
# trailing dot: a whole section). docs/training.md lists them
# (tests/environments/judge/test_judge_resume.py checks it).
RESUMABLE_CHANGES = ("training.max_steps", "training.save_every", "training.eval_every",
                     "training.eval_samples", "training.eval_temperature",
                     "training.micro_batch_size", "training.max_nonfinite_steps",
                     "model.threads", "model.device",
                     "reward.timeout_s", "backend.max_concurrent", "backend.request_timeout_s",
                     "reward.judge.base_url", "reward.judge.api_key_env", "reward.judge.timeout_s",
                     "reward.judge.retries", "reward.judge.max_concurrent",
                     "reward.judge.max_failed_steps", "logging.", "campaign.",
                     "training.budget_usd", "training.budget_tokens", "cost.",
                     "distributed.")
PREFIX = runlog.CHECKPOINT_PREFIX
POINT_SUFFIX = ".json"   # checkpoints/step-000012.json: the resume point of step 12


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:06d}"


@dataclass
class Start:
    """How a launch begins: fresh (state None), resumed, or already finished. `fallbacks`
    are older resume points, newest first, for when the chosen checkpoint does not load.
    `sft_steps`: the run's [sft] steps, as fixed when it started."""

    state: runlog.RunState | None
    finished: bool = False
    moved_to: Path | None = None
    fallbacks: list[runlog.RunState] = field(default_factory=list)
    note: str = ""
    sft_steps: int = 0


def prepare(run_dir: Path, cfg: Config, *, new: bool, sft_steps: int = 0,
            digests: list[DataDigest] | None = None) -> Start:
    """Decide fresh / resume / finished for `run_dir` (see the module docstring).
    `sft_steps`: the [sft] steps the config asks for now (a run keeps those it started with);
    `digests`: the data the run reads now (a resume must read what it started on)."""
    read = runlog.read_state(run_dir)
    points = resume_points(run_dir, read.state)
    if new and run_dir.exists() and any(run_dir.iterdir()):
        _refuse_if_live(run_dir, read.state)
        return Start(state=None, moved_to=_move_aside(run_dir), sft_steps=sft_steps)
    if not points:
        _refuse_to_overwrite(run_dir, read)
        return Start(state=None, sft_steps=sft_steps)
    state = points[0]
    # Only state.json says whether a process is training now: a resume point always reads
    # "running" with the pid of a process that may be long gone (or reused).
    _refuse_if_live(run_dir, read.state)
    _check_same_config(run_dir, cfg)
    sft_steps = fixed_sft_steps(state, sft_steps)
    last = sft_steps + cfg.training.max_steps
    note = "" if state is read.state else (
        f"state.json {_what_is_wrong(read)}; resuming from the resume point saved with "
        f"checkpoint {checkpoint_name(state.step)}")
    if state.status == "completed" and state.step >= last:
        return Start(state=state, finished=True, note=note, sft_steps=sft_steps)
    if state.step > last:
        what = f"{sft_steps} [sft] steps + " if sft_steps else ""
        raise UserError(f"{run_dir} already ran {state.step} steps, more than {what}"
                        f"training.max_steps = {cfg.training.max_steps}; raise max_steps or "
                        "start over with --new")
    run_facts.check_unchanged(run_dir, state, digests or [])
    return Start(state=state, fallbacks=points[1:], note=note, sft_steps=sft_steps)


def fixed_sft_steps(state: runlog.RunState, asked: int) -> int:
    """The [sft] steps a run started with (its resume points keep them): a count derived
    from the data's rows must not move when the data does; `asked` for older runs."""
    saved = state.extra.get(run_facts.SFT_STEPS)
    return saved if isinstance(saved, int) and not isinstance(saved, bool) and saved >= 0 \
        else asked


def resume_points(run_dir: Path, state: runlog.RunState | None) -> list[runlog.RunState]:
    """Sound states to resume from, newest step first: state.json (when sound and past
    step 0) and every checkpoint's resume point. At equal steps state.json wins (it knows
    whether the run completed)."""
    found: dict[int, runlog.RunState] = {}
    if state is not None and state.step > 0 and not state.resume_problem():
        found[state.step] = state
    folder = run_dir / runlog.CHECKPOINT_DIR
    for path in _listdir(folder):
        step = _step_of(path.name)
        if step is None or not path.name.endswith(POINT_SUFFIX) or step in found:
            continue
        point = _read_point(run_dir, path)
        if point is not None and point.step == step:
            found[step] = point
    return [found[k] for k in sorted(found, reverse=True)]


def save_resume_point(run_dir: Path, state: runlog.RunState) -> None:
    """Write the resume point of checkpoint `state.step` (before state.json points at it)."""
    path = run_dir / runlog.CHECKPOINT_DIR / f"{checkpoint_name(state.step)}{POINT_SUFFIX}"
    runlog.write_json_atomic(path, runlog.state_record(run_dir, state))


@dataclass
class PendingCommit:
    """A step's checkpoint whose save may still be in flight (a remote save overlapping the
    next step): state.json moves to it only once the save has landed."""

    state: runlog.RunState   # the run after the step; `checkpoint` is filled in on landing
    saved: Future[str]       # the backend's save_state_async

    def land(self, run_dir: Path, save_every: int, max_steps: int) -> runlog.RunState:
        self.state.checkpoint = self.saved.result()
        save_resume_point(run_dir, self.state)  # the checkpoint carries its resume point
        runlog.save_state(run_dir, self.state)
        prune(run_dir / runlog.CHECKPOINT_DIR, self.state.step, save_every, max_steps)
        return self.state


DIVERGED = "diverged-"  # a checkpoint set aside: resume and prune both leave it alone


def set_aside(run_dir: Path, step: int) -> str:
    """Rename checkpoint `step` and its resume point to `diverged-step-N` (kept, never
    resumed from); returns the new folder's path relative to the run folder."""
    folder = run_dir / runlog.CHECKPOINT_DIR
    name = checkpoint_name(step)
    for old in (folder / name, folder / f"{name}{POINT_SUFFIX}"):
        with contextlib.suppress(OSError):
            old.replace(folder / f"{DIVERGED}{old.name}")
    return f"{runlog.CHECKPOINT_DIR}/{DIVERGED}{name}"


def _read_point(run_dir: Path, path: Path) -> runlog.RunState | None:
    try:
        point = runlog.read_record(run_dir, path)
    except (OSError, ValueError, TypeError):
        return None
    return None if point.resume_problem() else point


def _listdir(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def _refuse_to_overwrite(run_dir: Path, read: runlog.StateRead) -> None:
    """A fresh start truncates metrics and checkpoints: never do it over trained steps."""
    rows = runlog.read_metrics(run_dir / runlog.METRICS_FILE).rows
    steps = [r["step"] for r in rows if isinstance(r.get("step"), int)]
    ckpts = sorted(p.name for p in _listdir(run_dir / runlog.CHECKPOINT_DIR)
                   if _step_of(p.name) is not None)
    if max(steps, default=0) < 2 and not ckpts:
        return  # at most the first step, never committed: nothing a fresh start would lose
    held = [f"{len(rows)} metrics rows up to step {max(steps, default=0)}"]
    if ckpts:
        held.append(f"checkpoints {', '.join(ckpts[-3:])}" + (" ..." if len(ckpts) > 3 else ""))
    raise UserError(f"{run_dir} holds a run ({'; '.join(held)}) but its state.json "
                    f"{_what_is_wrong(read)} and no checkpoint carries a usable resume point, "
                    "so it cannot be resumed; nothing was changed. Restore state.json, or "
                    f"run again with --new to move the folder aside (to {run_dir.name}.prev-"
                    "<time>) and start over")


def _what_is_wrong(read: runlog.StateRead) -> str:
    if read.state is not None:
        problem = read.state.resume_problem()
        return f"cannot be resumed from ({problem})" if problem else "is behind its checkpoints"
    return f"is unusable ({read.problem})" if read.problem else "is missing"


def _refuse_if_live(run_dir: Path, state: runlog.RunState | None) -> None:
    if state and state.status == "running" and runlog.pid_alive(state.pid, state.host):
        raise UserError(f"{run_dir} is being trained by process {state.pid}; stop it first "
                        "(Ctrl-C or kill it) or pick another logging.run_name")


def _move_aside(run_dir: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = run_dir.with_name(f"{run_dir.name}.prev-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = run_dir.with_name(f"{run_dir.name}.prev-{stamp}-{n}")
    run_dir.rename(target)
    return target


def _check_same_config(run_dir: Path, cfg: Config) -> None:
    saved_path = run_dir / runlog.CONFIG_FILE
    try:
        saved = loads_config(saved_path.read_text(encoding="utf-8"), str(saved_path))
    except (OSError, ConfigError):
        return  # nothing reliable to compare with; the checkpoint check still applies
    changed = [(k, old, new) for k, old, new in _changes(to_dict(saved), to_dict(cfg))
               if not k.startswith(RESUMABLE_CHANGES)]
    if changed:
        shown = "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in changed[:5])
        raise UserError(f"{run_dir} was started with a different config ({shown}); resuming "
                        "would mix two experiments. Restore those keys, pick another "
                        "logging.run_name, or start over with --new")


def _changes(before: dict, after: dict) -> list[tuple[str, object, object]]:
    """(key, before, after) of every changed key; a table inside a section ([reward.judge],
    [sft.data]) key by key, so a message names `reward.judge.model`, not `reward.judge`."""
    out: list[tuple[str, object, object]] = []
    for key, (old, new) in diff(before, after).items():
        if not isinstance(old, dict) and not isinstance(new, dict):
            out.append((key, old, new))
            continue
        old, new = old if isinstance(old, dict) else {}, new if isinstance(new, dict) else {}
        out += [(f"{key}.{k}", old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys())
                if old.get(k) != new.get(k)]
    return out


def ensure_writable(run_dir: Path) -> None:
    """Fail fast, before a model loads, when the run folder cannot be created or written
    (log_dir is a file, read-only, full): one line naming the folder and the fix."""
    import tempfile

    from retrain.errors import user_error_from_os

    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir) as fh:
            fh.write(b"retrain")
            fh.flush()
    except OSError as exc:
        raise user_error_from_os(exc, "logging.log_dir") from None


def prune(folder: Path, current: int, save_every: int, max_steps: int) -> None:
    """Delete checkpoints other than the current one, every `save_every`-th and the final."""
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        if path.name.startswith(f".{PREFIX}"):  # a save that never finished
            _remove(path)
            continue
        step = _step_of(path.name)
        if step is None or step in (current, max_steps):
            continue
        if step > current or not (save_every and step % save_every == 0):
            _remove(path)


def _remove(path: Path) -> None:
    """A checkpoint folder or a resume point file (best effort, like the rest of pruning)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _step_of(name: str) -> int | None:
    """12 for `step-000012` (a checkpoint) and `step-000012.json` (its resume point)."""
    return runlog.checkpoint_step(name.removesuffix(POINT_SUFFIX))


def first_loadable(run_dir: Path, points: list[runlog.RunState],
                   load: Callable[[runlog.RunState], None],
                   say: Callable[[str], None]) -> runlog.RunState:
    """The first resume point (newest first) that `load` accepts; a UserError naming every
    failure, with nothing changed, when none does."""
    failures = []
    for saved in points:
        try:
            load(saved)
            return saved
        except (BackendError, ValueError, TypeError, KeyError, AttributeError) as exc:
            failures.append(f"{saved.checkpoint!r} ({type(exc).__name__}: {exc})"[:300])
            say(f"cannot resume from checkpoint {failures[-1]}")
    raise UserError(f"{run_dir}: cannot resume from any checkpoint: " + "; ".join(failures)
                    + ". Nothing was changed; start over with --new (moves this folder aside)")

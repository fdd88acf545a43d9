"""The run folder as a resume point: what to do with an existing folder, checkpoint retention.

Resume rules (single runs):
- no folder, or no state.json: a fresh run;
- status completed and `max_steps` not raised: nothing to do (exit 0);
- a live process already running it: refuse;
- otherwise resume after the last checkpointed step, provided the config did not change in
  a key that alters the training (keys in `RESUMABLE_CHANGES` may change);
- `--new`: the old folder is moved aside to `<run>.prev-<timestamp>` (never deleted).

Checkpoints: the trainer saves one after EVERY step (a LoRA adapter + optimizer is small), so
a kill loses at most the step in flight. `prune` keeps the newest, every `save_every`-th and
the final one; the rest are deleted once a newer checkpoint is committed in state.json.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from retrain import runlog
from retrain.config import Config, ConfigError, dumps_config, loads_config, to_dict
from retrain.errors import UserError

# Keys that may differ between the first launch and a resume without changing the math.
RESUMABLE_CHANGES = ("training.max_steps", "training.save_every", "training.eval_every",
                     "training.micro_batch_size", "model.threads", "model.device",
                     "reward.timeout_s", "backend.max_concurrent", "backend.request_timeout_s",
                     "logging.")
PREFIX = "step-"


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:06d}"


@dataclass
class Start:
    """How a launch begins: fresh (state None), resumed, or already finished."""

    state: runlog.RunState | None
    finished: bool = False
    moved_to: Path | None = None


def prepare(run_dir: Path, cfg: Config, *, new: bool) -> Start:
    """Decide fresh / resume / finished for `run_dir` (see the module docstring)."""
    state = runlog.load_state(run_dir)
    moved_to = None
    if new and run_dir.exists() and any(run_dir.iterdir()):
        _refuse_if_live(run_dir, state)
        moved_to = _move_aside(run_dir)
        state = None
    if state is None or state.step == 0:
        return Start(state=None, moved_to=moved_to)
    _refuse_if_live(run_dir, state)
    _check_same_config(run_dir, cfg)
    if state.status == "completed" and state.step >= cfg.training.max_steps:
        return Start(state=state, finished=True)
    if state.step > cfg.training.max_steps:
        raise UserError(f"{run_dir} already ran {state.step} steps, more than "
                        f"training.max_steps = {cfg.training.max_steps}; raise max_steps or "
                        "start over with --new")
    return Start(state=state)


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
    changed = [k for k in _diff(to_dict(saved), to_dict(cfg))
               if not k.startswith(RESUMABLE_CHANGES) and not k.startswith("campaign.")]
    if changed:
        old, new = _flat(to_dict(saved)), _flat(to_dict(cfg))
        shown = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed[:5])
        raise UserError(f"{run_dir} was started with a different config ({shown}); resuming "
                        "would mix two experiments. Restore those keys, pick another "
                        "logging.run_name, or start over with --new")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and not prefix:
            out.update(_flat(v, f"{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _diff(a: dict, b: dict) -> list[str]:
    fa, fb = _flat(a), _flat(b)
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))


def write_config(run_dir: Path, cfg: Config) -> None:
    """The resolved config, re-runnable as is (rewritten on every launch)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{runlog.CONFIG_FILE}.tmp"
    tmp.write_text(dumps_config(cfg), encoding="utf-8")
    tmp.replace(run_dir / runlog.CONFIG_FILE)


def prune(folder: Path, current: int, save_every: int, max_steps: int) -> None:
    """Delete checkpoints other than the current one, every `save_every`-th and the final."""
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        if path.name.startswith(f".{PREFIX}"):  # a save that never finished
            shutil.rmtree(path, ignore_errors=True)
            continue
        step = _step_of(path.name)
        if step is None or step in (current, max_steps):
            continue
        if step > current or not (save_every and step % save_every == 0):
            shutil.rmtree(path, ignore_errors=True)


def _step_of(name: str) -> int | None:
    if not name.startswith(PREFIX):
        return None
    try:
        return int(name[len(PREFIX):])
    except ValueError:
        return None

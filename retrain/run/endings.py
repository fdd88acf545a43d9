"""How a run starts and ends: its state marked running, the guard around its steps (Ctrl-C,
a backend's one-line error, a full disk), the one-line errors for diverged weights and for too
many non-finite steps, and the first few reward or environment failures said aloud. Shared by
the RL trainer and the SFT stage."""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from retrain.backends.base import BackendError, DivergedError
from retrain.run import checkpoint
from retrain.run.stop_request import StopRequest
from retrain.runfiles import runlog

REPORTED_REWARD_ERRORS = 3  # print the first few scorer failures; the rest are only counted
DIVERGED_FIX = ("Lower training.lr or training.weight_decay and start over with --new "
                "(resuming as is repeats the divergence)")


def mark_running(run_dir: Path, state: runlog.RunState, last_step: int) -> None:
    """Save `state` as running in this process, towards `last_step`."""
    state.status, state.pid, state.host = "running", os.getpid(), socket.gethostname()
    state.started_at = state.started_at or time.time()
    state.max_steps, state.error = last_step, ""
    runlog.save_state(run_dir, state)


def to_the_end(run_dir: Path, loop: Callable[[], int], interrupted: Callable[[], int],
               fail: Callable[[BaseException], None]) -> int:
    """`loop()`'s exit code; Ctrl-C (or a stop signal) gives `interrupted()`'s; a BackendError
    is recorded by `fail`, said in one line and gives 1; anything else is recorded and raised
    (a full disk as one line for the CLI)."""
    try:
        return loop()
    except KeyboardInterrupt:
        return interrupted()
    except BackendError as exc:
        fail(exc)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BaseException as exc:
        full = runlog.disk_full_error(exc, run_dir)
        fail(full or exc)
        if full is not None:
            raise full from exc  # the CLI turns it into one line
        raise


def record_failure(run_dir: Path, state: runlog.RunState, exc: BaseException) -> None:
    """Save `state` as failed with `exc`, even on a full disk (never hiding `exc`)."""
    state.status = "failed"
    state.error = f"{type(exc).__name__}: {exc}"[:2000]
    with contextlib.suppress(OSError):  # the original error matters more
        runlog.save_state_even_if_full(run_dir, state)


def record_interrupt(run_dir: Path, state: runlog.RunState, close_progress: Callable[[], None],
                     last_step: int, config_path: Path | str, phase: str = "") -> None:
    """Save `state` as interrupted, close the progress line and say how to resume (`phase`:
    e.g. " (SFT)", after the step count)."""
    state.status = "interrupted"
    runlog.save_state(run_dir, state)
    close_progress()
    print(f"interrupted after step {state.step}/{last_step}{phase}; checkpoint saved. Resume "
          f"with the same command (e.g. `retrain {config_path}`).", file=sys.stderr, flush=True)


def record_budget(run_dir: Path, state: runlog.RunState, close_progress: Callable[[], None],
                  last_step: int, why: str) -> int:
    """Save `state` as stopped by its budget, say why and how to go on; the exit status."""
    state.status, state.error = runlog.BUDGET, why
    runlog.save_state(run_dir, state)
    close_progress()
    print(f"stopped after step {state.step}/{last_step}: {why}; checkpoint saved. Raise the "
          "budget and rerun the same command to continue.", file=sys.stderr, flush=True)
    return runlog.BUDGET_EXIT


def say_broken_pipe(stop: StopRequest) -> None:
    """One line when the stop came from a closed stdout."""
    if stop.signum == signal.SIGPIPE:
        print("stdout was closed (broken pipe): stopping.", file=sys.stderr, flush=True)


def diverged(run_dir: Path, state: runlog.RunState, step: int, exc: DivergedError,
             saved: bool) -> tuple[DivergedError, runlog.RunState]:
    """The error naming the last sound checkpoint, and the run's state after it. An update that
    diverged was undone and never saved; weights that sample NaN/inf were saved as the last
    checkpoint, which is moved aside (to `diverged-step-N`) so that a resume starts from the
    one before. `saved`: the weights sampled from are the last checkpoint's."""
    bad = state.step
    if not (exc.sampling and saved) or bad < 1:
        return DivergedError(f"weights diverged at step {step}: {exc}. Nothing non-finite "
                             f"was saved; the last checkpoint is step {bad}'s. "
                             f"{DIVERGED_FIX}"), state
    moved = checkpoint.set_aside(run_dir, bad)
    points = checkpoint.resume_points(run_dir, None)
    state = copy.deepcopy(points[0]) if points else runlog.RunState()
    back = f"step {state.step}" if points else "the start"
    return DivergedError(f"weights diverged at step {bad}: sampling step {step} met "
                         f"non-finite probabilities. Its checkpoint was moved to {moved}; "
                         f"the run now resumes from {back}, the last checkpoint whose "
                         f"sampling was finite. {DIVERGED_FIX}"), state


def too_many_nonfinite(step: int, streak: int, limit: int, checkpoint_ref: str) -> DivergedError:
    return DivergedError(
        f"{streak} steps in a row (steps {step - streak + 1}-{step}) had a non-finite loss or "
        f"gradient norm and were not applied (training.max_nonfinite_steps = {limit}); "
        f"stopped. The weights are unchanged since step {step - streak}; checkpoint "
        f"{checkpoint_ref} holds them. Check the reward and lower training.lr, then start "
        "over with --new")


class FailureReport:
    """Says the first REPORTED_REWARD_ERRORS steps' failures; the rest are only counted."""

    def __init__(self, say, scorer: bool):
        self.say, self.scorer, self.shown = say, scorer, 0

    def report(self, step: int, errors: list[str]) -> None:
        if not errors or self.shown >= REPORTED_REWARD_ERRORS:
            return
        self.shown += 1
        counted = "reward_failures" if self.scorer else "env_errors"
        more = "" if self.shown < REPORTED_REWARD_ERRORS else \
            f" (further failures are only counted in {counted})"
        what = "reward function" if self.scorer else "environment"
        self.say(f"step {step}: {what} failed: {errors[0]}{more}")

"""How a run ends when it cannot go on: the one-line errors for diverged weights and for too
many non-finite steps, and the first few reward or environment failures said aloud."""

from __future__ import annotations

import copy
from pathlib import Path

from retrain.backends.base import DivergedError
from retrain.run import checkpoint
from retrain.runfiles import runlog

REPORTED_REWARD_ERRORS = 3  # print the first few scorer failures; the rest are only counted
DIVERGED_FIX = ("Lower training.lr or training.weight_decay and start over with --new "
                "(resuming as is repeats the divergence)")


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

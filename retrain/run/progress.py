"""Step progress: a rich progress bar on a terminal, one plain line per step otherwise."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from retrain.machine.cpu import available_cores, busy_note

SKIPPED_NOTE = "skipped_nonfinite (loss or grad norm not finite: update not applied)"


def step_summary(row: dict) -> str:
    """The few numbers worth reading every step."""
    parts = [f"reward {_short(row['mean_reward'])}", f"correct {row['correct_rate']:.2f}",
             f"loss {row['loss']:+.4f}", f"bs {row['batch_size']}x{row['group_size']}",
             f"{row['step_time_s']:.1f}s (sample {row['sample_time_s']:.1f} "
             f"reward {row['reward_time_s']:.1f} train {row['train_time_s']:.1f})"]
    if "bp_regime" in row:
        parts.append(f"bp {row['bp_regime']}")
    if row.get("skipped_nonfinite"):
        parts.append(SKIPPED_NOTE)
    if row.get("eval_accuracy") is not None:
        parts.append(f"eval {row['eval_accuracy']:.3f}")
    busy = busy_note(row.get("load_average"), available_cores())
    if busy:
        parts.append(busy)
    return "  ".join(parts)


def _short(x: float) -> str:
    """3 decimals, or 3 significant digits for rewards far from 1 (a 1e200 reward)."""
    return f"{x:.3f}" if abs(x) < 1e6 else f"{x:.3g}"


class Progress:
    """`start(total, done)`, `step(row)`, `say(text)`, `close()`; rich only when on a TTY."""

    def __init__(self, run_name: str, stream: Any = None):
        self.run_name = run_name
        self.stream = stream or sys.stdout
        self.total = 0
        self._bar: Any = None
        self._task: Any = None
        self.output_closed = False  # the reader of a pipe left (`retrain ... | head`)

    def start(self, total: int, done: int) -> None:
        self.total = total
        if not self.stream.isatty():
            return
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        self._bar = RichProgress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeRemainingColumn(), TextColumn("{task.fields[info]}"), transient=False)
        self._bar.start()
        self._task = self._bar.add_task(self.run_name, total=total, completed=done, info="")

    def step(self, row: dict) -> None:
        if self._bar is not None:
            busy = busy_note(row.get("load_average"), available_cores())
            info = (f"reward {_short(row['mean_reward'])}  {row['step_time_s']:.1f}s/step"
                    + (f"  bp {row['bp_regime']}" if "bp_regime" in row else "")
                    + (f"  {busy}" if busy else ""))
            self._bar.update(self._task, completed=row["step"], info=info)
            if row.get("skipped_nonfinite"):
                self.say(f"step {row['step']}: {SKIPPED_NOTE}")
            if row.get("eval_accuracy") is not None:
                self.say(f"step {row['step']}: eval accuracy {row['eval_accuracy']:.3f}")
        else:
            self.say(f"step {row['step']}/{self.total}  {step_summary(row)}")

    def say(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        elif not self.output_closed:
            try:
                print(text, file=self.stream, flush=True)
            except BrokenPipeError:
                self._reader_left()

    def _reader_left(self) -> None:
        """Stop writing (the trainer then stops after the step, resumable) and point the
        stream at /dev/null so the interpreter's final flush does not fail again."""
        self.output_closed = True
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

"""The SFT stage: supervised steps on the conversations of [sft.data] before the RL steps of
the same run.

The run's steps 1..S are SFT steps (S = sft.steps, or sft.epochs passes over the
conversations); its RL steps follow as S+1..S+training.max_steps. One SFT step, in order:
the next sft.batch_size conversations from a seeded cursor, their datums (weight 1 on the
assistant's tokens only: environments/sft_datums.py), one `forward_backward` with the
`cross_entropy` loss (the mean over the batch's assistant tokens) and one `optim_step` at
sft.lr with the [training] AdamW settings, a metrics row (phase "sft", sft_loss), a
checkpoint. Its resume points are the RL steps' (state.json, checkpoints/step-N.json), marked
phase "sft", with the stage's cursor as data_cursor: a killed run resumes exactly. The RL
steps start on the weights of step S, and AdamW's moments carry on into them.

It deliberately has no schedule (a constant lr), no held-out loss and no packing: one
conversation is one datum.
"""

from __future__ import annotations

import copy
import signal
import time
from pathlib import Path

from retrain.backends.base import (
    AdamParams,
    Backend,
    DivergedError,
    LossConfig,
    skipped_nonfinite,
)
from retrain.config.cost_section import CostConfig
from retrain.config.sections import SftConfig, TrainingConfig
from retrain.environments.ledger import Renderer
from retrain.environments.sft.data import SftData
from retrain.environments.sft.datums import SftExample, sft_example
from retrain.environments.tasks import DataCursor
from retrain.errors import UserError
from retrain.run import checkpoint, endings
from retrain.run.progress import Progress
from retrain.run.record import RunRecord
from retrain.run.run_facts import RunFacts
from retrain.run.seeds import derive_seed
from retrain.run.spend import Spend
from retrain.run.step_row import max_rss_mb
from retrain.run.stop_request import StopRequest
from retrain.run.trackers import Trackers
from retrain.runfiles import runlog

PHASE = "phase"   # the state.extra key that marks an SFT step's resume point
SFT = "sft"
SFT_LOSS = LossConfig(name="cross_entropy", aggregation="token_mean", temperature=1.0)


def is_sft_point(state: runlog.RunState) -> bool:
    """Whether `state` is the resume point of an SFT step (its data_cursor is the stage's)."""
    return state.extra.get(PHASE) == SFT


class SftStage:
    """The SFT steps of one run; `run` returns the exit status and the state after them."""

    def __init__(self, sft: SftConfig, training: TrainingConfig, cost: CostConfig,
                 record: RunRecord, data: SftData, run_dir: Path, backend: Backend,
                 config_path: Path, facts: RunFacts):
        self.sft, self.training, self.record = sft, training, record
        self.data, self.run_dir, self.backend = data, run_dir, backend
        self.config_path = config_path
        self.facts, self.steps = facts, facts.sft_steps  # fixed when the run started
        self.last_step = self.steps + training.max_steps  # the run's last step
        seed = derive_seed(training.seed, 0, "sft-data")
        self.cursor = DataCursor(data.rows, seed, data.data.shuffle)
        self.renderer = Renderer(backend.tokenizer, data.data.chat_template)
        self.limit = min(sft.max_tokens, backend.max_context or sft.max_tokens)
        eos = getattr(backend.tokenizer, "eos_token_id", None)  # ends a reply without a template
        self.eos = eos if isinstance(eos, int) else None
        self.progress = Progress(record.run_name)
        self.stop = StopRequest()
        self.state = runlog.RunState()
        self.streak = 0   # steps in a row not applied for a non-finite loss or gradient
        self.spend = Spend(run_dir, backend, cost, training)  # each row's tokens and time
        self.examples: dict[int, SftExample] = {}  # by row, tokenized once
        self.said_untrainable = False

    def run(self, points: list[runlog.RunState]) -> tuple[int, runlog.RunState]:
        """The SFT steps not done yet, after the newest of `points` that loads (none: from
        the start). Returns (exit status, the state after the last step done)."""
        self._refuse_if_nothing_trains()
        first = self._restore(points) if points else self._fresh()
        trackers = self.record.open(self.run_dir)  # config.toml, then the trackers
        endings.mark_running(self.run_dir, self.state, self.last_step)
        self.stop.install()
        try:
            code = endings.to_the_end(self.run_dir, lambda: self._loop(first, trackers),
                                      self._interrupted, self._fail)
            return code, self.state
        finally:
            self.stop.restore()
            self.progress.close()
            trackers.close()

    def _fresh(self) -> int:
        runlog.truncate_metrics(self.run_dir / runlog.METRICS_FILE, 0)
        self.state = runlog.RunState()
        self.facts.stamp(self.state)
        return 1

    def _restore(self, points: list[runlog.RunState]) -> int:
        saved = checkpoint.first_loadable(self.run_dir, points, self._load_point,
                                          self.progress.say)
        dropped = runlog.truncate_metrics(self.run_dir / runlog.METRICS_FILE, saved.step)
        self.state = saved
        self.facts.stamp(self.state)
        note = f" (dropped {dropped} metrics rows written after it)" if dropped else ""
        if saved is not points[0]:
            note += f" (fell back from step {points[0].step}: its checkpoint did not load)"
        self.progress.say(f"resuming {self.run_dir} after step {saved.step} (SFT){note}")
        return saved.step + 1

    def _load_point(self, saved: runlog.RunState) -> None:
        self.backend.load_state(saved.checkpoint)
        self.cursor.load_state_dict(saved.data_cursor)
        streak = saved.extra.get("nonfinite_streak", 0)
        self.streak = streak if isinstance(streak, int) and streak > 0 else 0

    def _loop(self, first: int, trackers: Trackers) -> int:
        if first <= self.steps:
            self.progress.say(f"SFT: steps {first}-{self.steps} on {self.data.where} "
                              f"({self.data.rows} conversations), then "
                              f"{self.training.max_steps} RL steps")
        with runlog.MetricsWriter(self.run_dir / runlog.METRICS_FILE) as writer:
            for step in range(first, self.steps + 1):
                if why := self.spend.crossed():  # [training] budget_*: stop between steps
                    return endings.record_budget(self.run_dir, self.state, self.progress.close,
                                                 self.last_step, why)
                row = self._step(step)
                self.streak = self.streak + 1 if row["skipped_nonfinite"] else 0
                self.spend.into(row)
                writer.write(row)
                trackers.log(row)
                self.progress.say(step_line(row, self.steps))
                self._commit(step)
                if self.streak >= self.training.max_nonfinite_steps:
                    raise endings.too_many_nonfinite(step, self.streak,
                                                     self.training.max_nonfinite_steps,
                                                     self.state.checkpoint)
                if self.progress.output_closed and self.stop.signum is None:
                    self.stop.signum = signal.SIGPIPE  # `retrain ... | head`: the reader left
                if self.stop.signum is not None and step < self.last_step:
                    return self._interrupted()
        if self.last_step == self.steps:  # training.max_steps = 0: an SFT run
            self.state.status = "completed"
            runlog.save_state(self.run_dir, self.state)
            self.progress.say(f"finished {self.steps} SFT steps; adapter: "
                              f"{self.state.checkpoint}")
        return 0

    def _step(self, step: int) -> dict:
        """One SFT step's update and its metrics row."""
        start = time.perf_counter()
        epoch = self.cursor.epoch  # the epoch of the step's first row (take may end it)
        index = self.cursor.take(self.sft.batch_size)
        examples = [self._example(i) for i in index]
        datums = [e.datum() for e in examples if e.trained_tokens]
        loss, grad_norm, skipped = None, 0.0, False
        if datums:  # every conversation cut before its reply: nothing to learn this step
            t = self.training
            out = self.backend.forward_backward(datums, SFT_LOSS)
            try:
                optim = self.backend.optim_step(AdamParams(
                    learning_rate=self.sft.lr, beta1=t.beta1, beta2=t.beta2, eps=t.adam_eps,
                    weight_decay=t.weight_decay, grad_clip_norm=t.grad_clip_norm))
            except DivergedError as exc:
                raise endings.diverged(self.run_dir, self.state, step, exc, True)[0] from None
            loss, grad_norm = out.loss, optim.grad_norm
            skipped = skipped_nonfinite(optim.metrics)
        seconds = time.perf_counter() - start
        return {"step": step, "phase": SFT, "sft_loss": loss, "grad_norm": grad_norm,
                "lr": self.sft.lr, "skipped_nonfinite": skipped,
                **sft_counts(examples, len(datums), epoch, seconds)}

    def _example(self, i: int) -> SftExample:
        """Conversation `i` as trained, tokenized once for the whole run."""
        if i not in self.examples:
            self.examples[i] = self._tokenize(i)
            if not self.examples[i].trained_tokens and not self.said_untrainable:
                self.said_untrainable = True
                self.progress.say(f"sft.data: conversation {i + 1} of {self.data.where} trains "
                                  f"no token: its reply starts past sft.max_tokens = "
                                  f"{self.limit}, or is empty; such conversations are skipped "
                                  "(said once; `retrain explain` counts them)")
        return self.examples[i]

    def _refuse_if_nothing_trains(self) -> None:
        """One line, before anything is written, when no conversation reaches its reply
        within sft.max_tokens: the stage would report success having trained nothing."""
        for i in range(self.data.rows):  # stops at the first that trains (usually row 1)
            self.examples.setdefault(i, self._tokenize(i))
            if self.examples[i].trained_tokens:
                return
        shortest = min(e.tokens for e in self.examples.values())
        raise UserError(f"sft.data: no conversation of {self.data.where} trains a token within "
                        f"sft.max_tokens = {self.limit} (every reply starts past it or is "
                        f"empty; the shortest is {shortest} tokens after the cut): raise "
                        "sft.max_tokens or shorten the prompts")

    def _tokenize(self, i: int) -> SftExample:
        try:
            return sft_example(self.renderer, self.data.conversations[i], self.limit, self.eos)
        except Exception as exc:  # the tokenizer's template refuses it (roles, order)
            raise UserError(f"sft.data: conversation {i + 1} of {self.data.where} cannot be "
                            f"rendered with the model's chat template ({type(exc).__name__}: "
                            f"{str(exc)[:200]}); fix the row, or set sft.data.chat_template = "
                            "false") from None

    def _commit(self, step: int) -> None:
        """Checkpoint the step and point state.json at it (at once: nothing to overlap)."""
        saved = self.backend.save_state_async(checkpoint.checkpoint_name(step))
        s = copy.deepcopy(self.state)
        s.step, s.batch_size = step, self.sft.batch_size
        s.data_cursor = self.cursor.state_dict()
        s.rng = {"scheme": "derived from training.seed and the step", "seed": self.training.seed}
        s.extra[PHASE] = SFT
        s.extra["nonfinite_streak"] = self.streak
        self.state = checkpoint.PendingCommit(s, saved).land(
            self.run_dir, self.training.save_every, self.last_step)

    def _interrupted(self) -> int:
        endings.say_broken_pipe(self.stop)
        endings.record_interrupt(self.run_dir, self.state, self.progress.close, self.last_step,
                                 self.config_path, " (SFT)")
        return self.stop.exit_code

    def _fail(self, exc: BaseException) -> None:
        endings.record_failure(self.run_dir, self.state, exc)


def sft_counts(examples: list[SftExample], sequences: int, epoch: int, seconds: float) -> dict:
    """An SFT step's counts and times (`sequences`: the conversations trained)."""
    tokens = sum(e.tokens for e in examples)
    return {"sft_sequences": sequences,
            "sft_tokens": sum(e.trained_tokens for e in examples), "sft_epoch": epoch,
            "sft_truncated": sum(e.truncated for e in examples),
            "sft_skipped_turns": sum(e.skipped_turns for e in examples),
            "step_time_s": seconds, "tokens_per_second": tokens / seconds if seconds else 0.0,
            "process_max_rss_mb": max_rss_mb(), "time": time.time()}


def step_line(row: dict, steps: int) -> str:
    loss = "-" if row["sft_loss"] is None else f"{row['sft_loss']:.4f}"
    return (f"sft step {row['step']}/{steps}  loss {loss}  {row['sft_tokens']} assistant "
            f"tokens in {row['sft_sequences']} conversations  {row['step_time_s']:.1f}s"
            + ("  skipped_nonfinite" if row["skipped_nonfinite"] else ""))

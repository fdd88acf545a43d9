"""The step loop of a single run: prompts -> sample -> reward -> advantages -> train.

One step, in order: take `batch_size` prompts from the data cursor, sample `group_size`
completions for each (one backend call), score them, compute group advantages, build the
shifted datums of the groups that carry signal, `forward_backward` + `optim_step`, let the
back-pressure controller observe the step, append the metrics row, save a checkpoint.

Exact resume: every step's randomness is derived from (training.seed, step), the data cursor,
the controller, the adapter and the optimizer are saved after every step, so a resumed run
repeats exactly what an uninterrupted run would have done.

With an [sft] stage (run/sft.py) its S steps come first: the RL steps are S+1..S+max_steps,
starting on the stage's weights; the lr schedule and evaluation count the RL steps alone.

Evaluation (greedy, held-out split): before the first step (logged as
`initial_eval_accuracy` on the step-1 row) and after the update of every `eval_every`-th step
and of the last step (logged as `eval_accuracy` on that step's row).
"""

from __future__ import annotations

import contextlib
import copy
import random
import signal
import time
from pathlib import Path
from typing import Any

from retrain.algorithms.lr import step_lr
from retrain.algorithms.schedule import lr_multiplier, warmup_problem
from retrain.backends.base import (
    Backend,
    BackendError,
    BackendOOMError,
    Datum,
    DivergedError,
    SamplingParams,
)
from retrain.control.gradnoise import GradStats, NoiseScale
from retrain.environments.rollout import RolloutResult, Rollouts, keyed, uses_scorer
from retrain.environments.tasks import DataCursor, TaskSplits
from retrain.machine.cpu import load_average
from retrain.run import checkpoint, endings
from retrain.run.batch import BatchBuilder
from retrain.run.eval import HeldOut
from retrain.run.offpolicy import Overlap
from retrain.run.progress import Progress
from retrain.run.record import RunRecord
from retrain.run.rl_sections import RlSections
from retrain.run.run_facts import RunFacts
from retrain.run.seeds import derive_seed
from retrain.run.sft import PHASE
from retrain.run.spend import Spend
from retrain.run.step_row import (
    SampledStep,
    max_rss_mb,
    ordered,
    rollout_row,
    step_work,
)
from retrain.run.stop_request import StopRequest
from retrain.run.trackers import Trackers
from retrain.run.update import NO_UPDATE, summary, update_batch
from retrain.runfiles import runlog

SCORER_STATE = "scorer"  # state.json's extra: the scorer's state (the judge's failed streak)
ADVANTAGE_NOTE = "+-65536"  # retrain.algorithms.advantages.LOSS_LIMIT, as the note shows it


class Trainer:
    """Owns the order of the stages; the backend, scorer and controller do the work."""

    def __init__(self, sections: RlSections, record: RunRecord, run_dir: Path, splits: TaskSplits,
                 scorer: Any, backend: Backend, slots: Any, config_path: Path,
                 rollouts: Rollouts, facts: RunFacts):
        from retrain.control.backpressure.controller import BackpressureController

        self.sections, self.record = sections, record
        self.training = sections.training
        self.run_dir = run_dir
        self.splits = splits
        self.scorer = scorer
        self.rollouts = rollouts
        self.backend = backend
        self.slots = slots
        self.config_path = config_path
        self.facts = facts  # the [sft] steps before these, fixed when the run started
        self.sft_steps = facts.sft_steps
        self.last_step = self.sft_steps + self.training.max_steps
        self.cursor = DataCursor(len(splits.train), self.training.seed, sections.data.shuffle)
        self.controller = BackpressureController(sections.backpressure, self.training.group_size,
                                                 base_batch_size=self.training.batch_size)
        self.noise = NoiseScale()
        self._train_metrics: dict = {}
        self.progress = Progress(record.run_name)
        self.stop = StopRequest()
        self.state = runlog.RunState()
        self.batch_size = self.training.batch_size
        self.failures = endings.FailureReport(self.progress.say, uses_scorer(sections.environment))
        self.heldout = HeldOut(backend, rollouts, splits.eval, scorer, sections.data,
                               self.training)
        self.batches = BatchBuilder(backend, rollouts.train.host, sections.algorithm,
                                    self.training, sections.reward)
        self.overlap = Overlap(backend, run_dir, enabled=self.training.max_steps_off_policy > 0)
        self.spend = Spend(run_dir, backend, sections.cost, self.training,
                           self.heldout)  # each row's tokens and time
        self._in_flight: checkpoint.PendingCommit | None = None  # the last step's checkpoint
        self._api_waited = 0.0         # API waits already counted in a row (api_wait_s)
        self.nonfinite_streak = 0      # steps in a row not applied for a non-finite loss/grad
        self._scaled_noted = False     # advantages were scaled down for the loss (said once)

    # ------------------------------------------------------------------ the run

    def run(self, resume: runlog.RunState | None,
            fallbacks: list[runlog.RunState] | None = None,
            after: runlog.RunState | None = None) -> int:
        """Steps until max_steps, an interrupt or an error; returns the exit status.
        `fallbacks`: older resume points, tried when `resume`'s checkpoint does not load.
        `after`: the SFT stage's last state (its weights are the backend's now)."""
        # Restore before writing anything: a resume that fails leaves the folder untouched.
        first = self._restore([resume, *(fallbacks or [])]) if resume else self._fresh(after)
        trackers = self.record.open(self.run_dir)  # config.toml, then the trackers
        endings.mark_running(self.run_dir, self.state, self.last_step)
        self.stop.install()
        try:
            return endings.to_the_end(self.run_dir, lambda: self._loop(first, trackers),
                                      self._interrupted, self._fail)
        finally:
            self.stop.restore()
            self.progress.close()
            trackers.close()

    def _fresh(self, after: runlog.RunState | None = None) -> int:
        if after is None:
            runlog.truncate_metrics(self.run_dir / runlog.METRICS_FILE, 0)
        self.state = after or runlog.RunState()
        self.state.extra.pop(PHASE, None)  # RL steps' states hold the RL cursor
        self.facts.stamp(self.state)
        self.batch_size = self.controller.first_batch_size(self.training.batch_size)
        return self.state.step + 1

    def _restore(self, points: list[runlog.RunState]) -> int:
        """Resume from the first point whose checkpoint and saved state load, newest first."""
        saved = checkpoint.first_loadable(self.run_dir, points, self._load_point,
                                          self.progress.say)
        dropped = runlog.truncate_metrics(self.run_dir / runlog.METRICS_FILE, saved.step)
        self.state = saved
        self.facts.stamp(self.state)
        # Hand-edited sizes must not make a step take 10**12 prompts: keep the configured range.
        limit = max(self.training.batch_size, self.sections.backpressure.max_batch_size)
        self.batch_size = saved.batch_size if 1 <= saved.batch_size <= limit else \
            self.training.batch_size
        # Resume points from before the controller owned the out-of-memory ceiling.
        self.controller.adopt_oom_cap(saved.extra.pop("oom_cap", None), limit)
        # The batch sampled ahead for the next step, if any (a damaged one is dropped).
        dropped_batch = self.overlap.restore(saved, len(self.splits.train),
                                             len(self.backend.tokenizer))
        if dropped_batch:
            self.progress.say(dropped_batch)
        note = f" (dropped {dropped} metrics rows written after it)" if dropped else ""
        if saved is not points[0]:
            note += f" (fell back from step {points[0].step}: its checkpoint did not load)"
        self.progress.say(f"resuming {self.run_dir} after step {saved.step}{note}")
        return saved.step + 1

    def _load_point(self, saved: runlog.RunState) -> None:
        """Load one resume point into the backend and the run's stateful parts."""
        self.backend.load_state(saved.checkpoint)
        self.cursor.load_state_dict(saved.data_cursor)
        self.controller.load_state_dict(saved.controller)
        self.noise.load_state_dict(saved.extra.get("grad_noise"))
        streak = saved.extra.get("nonfinite_streak", 0)
        self.nonfinite_streak = streak if isinstance(streak, int) and streak > 0 else 0
        if self.scorer is not None:  # the judge's failed streak goes on where it stopped
            self.scorer.load_state_dict(saved.extra.get(SCORER_STATE))

    def _loop(self, first: int, trackers: Trackers) -> int:
        self.progress.say(f"run folder: {self.run_dir}")
        if self.backend.summary:
            self.progress.say(f"model: {self.backend.summary}")
        t = self.training
        if warmup := warmup_problem(t.max_steps, t.warmup_steps, t.lr_schedule):
            self.progress.say(f"warning: {warmup}")
        initial = None
        if first == self.sft_steps + 1 and self.heldout.available():
            initial = self.heldout.run()
            self.progress.say(f"eval accuracy before training: {initial.accuracy:.3f} "
                              f"({initial.n} held-out problems, {initial.seconds:.1f}s)")
        self.progress.start(self.last_step, first - 1)
        with runlog.MetricsWriter(self.run_dir / runlog.METRICS_FILE) as writer:
            for step in range(first, self.last_step + 1):
                if why := self.spend.crossed():  # [training] budget_*: stop between steps
                    return self._over_budget(why)
                row = self._guarded(step, self._step, step)
                if initial is not None:
                    self.heldout.put(row, initial, prefix="initial_")
                    initial = None
                self._guarded(step, self._maybe_evaluate, step, row, saved=False)
                self.nonfinite_streak = self.nonfinite_streak + 1 if row["skipped_nonfinite"] \
                    else 0
                stop = self.nonfinite_streak >= self.training.max_nonfinite_steps
                self.spend.into(row)
                writer.write(row)
                trackers.log(row)
                self.progress.step(row)
                self._commit(step, wait=step == self.last_step
                             or self.stop.signum is not None or stop)
                if stop:
                    raise endings.too_many_nonfinite(step, self.nonfinite_streak,
                                                     self.training.max_nonfinite_steps,
                                                     self.state.checkpoint)
                if self.progress.output_closed and self.stop.signum is None:
                    self.stop.signum = signal.SIGPIPE  # `retrain ... | head`: the reader left
                if self.stop.signum is not None and step < self.last_step:
                    return self._interrupted()
        self.state.status = "completed"
        runlog.save_state(self.run_dir, self.state)
        self.progress.close()
        self.progress.say(f"finished {self.last_step} steps; checkpoint: "
                          f"{self.state.checkpoint}")
        return 0

    # ------------------------------------------------------------------ one step

    def _step(self, step: int) -> dict:
        """One step, retried with half the prompts (whole groups) while it runs out of memory."""
        start, waited = time.perf_counter(), self._api_waited
        saved_cursor = self.cursor.state_dict()
        batch_size, retries = self.overlap.planned_batch_size(step, self.batch_size), 0
        while True:
            attempt_start = time.perf_counter()
            try:
                sampled = self._attempt(step, batch_size)
                break
            except BackendOOMError as exc:
                if batch_size <= 1:
                    raise BackendError(f"step {step}: out of memory even with batch_size 1 "
                                       f"({exc}); lower training.group_size or "
                                       "training.max_tokens") from exc
                retries += 1
                # The controller knows which smaller sizes have worked; without it, halve.
                retry = self.controller.observe(batch_size, 0, time.perf_counter() - start,
                                                oom=True).batch_size
                if not 1 <= retry < batch_size:
                    retry = batch_size // 2
                self.progress.say(f"step {step}: out of memory at batch_size {batch_size}; "
                                  f"retrying with {retry}")
                batch_size = retry
                self.overlap.discard()
                self.cursor.load_state_dict(saved_cursor)
        end = time.perf_counter()
        step_time = end - start
        row = sampled.row
        self._api_waited = self._api_wait_s()  # what came before (setup, saves) counts here too
        row.update(step=step, step_time_s=step_time,
                   tokens_per_second=sampled.tokens / step_time if step_time > 0 else 0.0,
                   process_max_rss_mb=max_rss_mb(), api_wait_s=self._api_wait_s() - waited,
                   oom_retries=retries, load_average=load_average())
        # The controller measures the batch size that ran: failed attempts are not its time.
        decision = self.controller.observe(batch_size, sampled.tokens, end - attempt_start,
                                           flops=sampled.flops, bytes_moved=sampled.bytes_moved,
                                           noise_scale=sampled.noise_scale, work=sampled.work)
        self.batch_size = max(1, decision.batch_size)
        if decision.action != "hold" or "rejected" in decision.reason:
            self.progress.say(f"step {step}: back-pressure {decision.action} ({decision.regime}), "
                              f"batch_size {batch_size} -> {decision.batch_size}: "
                              f"{decision.reason}")
        self.failures.report(step, sampled.errors)
        return ordered(row, decision.metrics())

    def _attempt(self, step: int, batch_size: int) -> SampledStep:
        training = self.training
        random.seed(derive_seed(training.seed, step, "python"))  # for user reward code using random
        t0 = time.perf_counter()
        ahead = self.overlap.take(step)  # turn 0, sampled while the previous step trained
        if ahead is None:
            index, first = self._take(step, batch_size), None
        else:
            index, first = ahead.index, ahead.groups
            self.cursor.load_state_dict(ahead.cursor_after)
        rollout = self.rollouts.train
        result = rollout.run(index, training.group_size, self._sampling_params(step), first)
        t1 = time.perf_counter()
        if not training.refill:  # refill rounds take from the cursor first
            self._sample_ahead(step + 1)  # overlap: runs while this step trains
        batch = self.batches.build(result, batch_size, lambda r, k, drawn: rollout.run(
            self._take(step, k, drawn), training.group_size, self._sampling_params(step, r)))
        if training.refill:
            self._sample_ahead(step + 1)
        result, divisor = batch.result, batch.divisor
        if divisor != 1.0 and not self._scaled_noted:
            self._scaled_noted = True
            self.progress.say(f"step {step}: advantages beyond {ADVANTAGE_NOTE} were divided "
                              f"by {divisor:.3g} before the loss (rewards in large units; "
                              "said once)")
        t2 = time.perf_counter()
        lr = self._lr(step, batch_size)
        train = self._train(batch.groups, lr)
        t3 = time.perf_counter()
        row = self._row(result, batch_size, batch.rewards, train, lr)
        sampling = t1 - t0 + batch.refill_seconds - result.env_seconds
        row.update(sample_time_s=sampling, reward_time_s=t2 - t0 - sampling,
                   train_time_s=t3 - t2, trained_completions=sum(map(len, batch.groups)),
                   sample_staleness=ahead.staleness if ahead is not None else 0, **batch.metrics)
        episodes = [e for g in result.groups for e in g]
        work = step_work([[(e.ledger.context_tokens,
                            e.ledger.sampled_tokens) for e in g] for g in result.groups],
                         batch.advantages)
        sampled = SampledStep(row=row, work=work,
                              errors=list(rollout.host.errors)
                              + [f"episode {e.id}: {e.error}" for e in episodes if e.error])
        sampled.add_estimates(self.backend.cost_model, result.groups, self._train_metrics,
                              batch_size)
        return sampled

    def _row(self, result: RolloutResult, batch_size: int, rewards: list[list[float]],
             train: dict, lr: float) -> dict:
        row = rollout_row(result, rewards, batch_size, self.training.group_size, train)
        row.update(lr=lr, reward_failures=self.rollouts.train.host.failures)
        if not uses_scorer(self.sections.environment):
            row.update(result.metrics())
        return row

    def _take(self, step: int, batch_size: int, drawn: int = 0) -> list[int]:
        """The groups of a step: problem indices from the data cursor (task kind), else
        episode seeds derived from (training.seed, step, group index); `drawn`: groups this
        step already took (refill rounds)."""
        if uses_scorer(self.sections.environment) or self.sections.environment.kind == "task":
            return self.cursor.take(batch_size)
        return [derive_seed(self.training.seed, step, f"episode:{g}")
                for g in range(drawn, drawn + batch_size)]

    def _lr(self, step: int, batch_size: int) -> float:
        """The schedule's rate at `step`, scaled for the batch back-pressure chose."""
        t, bp = self.training, self.sections.backpressure
        lr = t.lr * lr_multiplier(step - self.sft_steps, t.max_steps, t.lr_schedule,
                                  t.warmup_steps, t.min_lr_ratio)
        return step_lr(lr, t.batch_size, batch_size, bp.lr_scaling, bp.enabled)

    def _train(self, groups: list[list[Datum]], lr: float) -> dict:
        """The step's updates (retrain.run.update); groups without signal are left out."""
        self._train_metrics = {}
        if not any(groups):  # every group uniform: nothing to learn from this step
            self._land_commit()
            return {**NO_UPDATE, **self.backend.thread_metrics()}  # every row has the threads
        done = update_batch(self.backend, groups, self.sections.algorithm, self.training, lr)
        row, self._train_metrics = summary(done)
        self._land_commit()  # the last step's save landed while this step's update ran
        if row["updates"]:  # skipped updates leave the weights (and staleness) as they were
            self.overlap.updated()
        # Measured on the local backend with two or more micro-batches, else None (docs).
        stats = GradStats.from_metrics(self._train_metrics) \
            if self.training.mini_batches == 1 else None
        row.update(grad_noise_scale=self.noise.update(stats),
                   grad_coherence=stats.coherence if stats else None,
                   grad_diagnostics_s=self._train_metrics.get("grad_diagnostics_s"))
        return row

    def _sampling_params(self, step: int, refill_round: int = 0) -> SamplingParams:
        training = self.training
        purpose = f"sample:refill:{refill_round}" if refill_round else "sample"
        return SamplingParams(max_tokens=training.max_tokens, temperature=training.temperature,
                              top_p=training.top_p, seed=derive_seed(training.seed, step, purpose),
                              stop_strings=tuple(training.stop))

    def _sample_ahead(self, step: int) -> None:
        """max_steps_off_policy = 1: start sampling `step`'s batch now, before this step's
        update, so it runs while this step trains (see retrain/run/offpolicy.py)."""
        if not self.overlap.enabled or step > self.last_step:
            return
        before = self.cursor.state_dict()
        index = self._take(step, self.batch_size)
        params = keyed(self._sampling_params(step), range(len(index)))  # as rollout.run keys
        self.overlap.start(step, index, [self.rollouts.train.prompt(i) for i in index],
                           self.training.group_size, params, before, self.cursor.state_dict())

    def _api_wait_s(self) -> float:
        """Time lost waiting for the API: for a campaign slot, or out a rate limit (429)."""
        return self.slots.wait_s + self.backend.rate_limit_wait_s

    # ------------------------------------------------------------------ eval, checkpoints

    def _maybe_evaluate(self, step: int, row: dict) -> None:
        if self.heldout.due(step - self.sft_steps):
            self.state.extra["eval_accuracy"] = self.heldout.into_row(row).accuracy

    def _commit(self, step: int, *, wait: bool) -> None:
        """Checkpoint the step. state.json moves to it once the save has landed: at once, or,
        with max_steps_off_policy >= 1, while the next step runs (its round trips overlap)."""
        self._land_commit()
        saved = self.backend.save_state_async(checkpoint.checkpoint_name(step))
        s = copy.deepcopy(self.state)
        s.step, s.batch_size = step, self.batch_size
        s.data_cursor, s.controller = self.cursor.state_dict(), self.controller.state_dict()
        s.rng = {"scheme": "derived from training.seed and the step", "seed": self.training.seed}
        s.extra["grad_noise"] = self.noise.state_dict()
        s.extra["nonfinite_streak"] = self.nonfinite_streak
        if self.scorer is not None:
            s.extra[SCORER_STATE] = self.scorer.state_dict()
        self.overlap.checkpoint(step, s)  # the batch sampled ahead for step + 1, if any
        self._in_flight = checkpoint.PendingCommit(s, saved)
        if wait or not self.overlap.enabled:
            self._land_commit()

    def _land_commit(self) -> None:
        """Wait for the checkpoint in flight, if any, and point state.json at it."""
        if self._in_flight is not None:
            pending, self._in_flight = self._in_flight, None
            self.state = pending.land(self.run_dir, self.training.save_every, self.last_step)

    # ------------------------------------------------------------------ endings

    def _interrupted(self) -> int:
        endings.say_broken_pipe(self.stop)
        with contextlib.suppress(BackendError):  # a save that failed leaves the step before
            self._land_commit()
        endings.record_interrupt(self.run_dir, self.state, self.progress.close, self.last_step,
                                 self.config_path)
        return self.stop.exit_code

    def _over_budget(self, why: str) -> int:
        self._land_commit()
        return endings.record_budget(self.run_dir, self.state, self.progress.close,
                                     self.last_step, why)

    def _guarded(self, step: int, call: Any, *args: Any, saved: bool = True) -> Any:
        """`call(*args)` for `step`; a DivergedError becomes the one-line "weights diverged"
        error. `saved`: the weights it samples from are the last checkpoint's (not so for the
        evaluation after an update, which is saved only after it)."""
        try:
            return call(*args)
        except DivergedError as exc:
            raise self._diverged(step, exc, saved) from None

    def _diverged(self, step: int, exc: DivergedError, saved: bool) -> DivergedError:
        with contextlib.suppress(BackendError):
            self._land_commit()
        error, self.state = endings.diverged(self.run_dir, self.state, step, exc, saved)
        return error

    def _fail(self, exc: BaseException) -> None:
        with contextlib.suppress(BackendError):
            self._land_commit()
        endings.record_failure(self.run_dir, self.state, exc)

"""The step loop of a single run: prompts -> sample -> reward -> advantages -> train.

One step, in order: take `batch_size` prompts from the data cursor, sample `group_size`
completions for each (one backend call), score them, compute group advantages, build the
shifted datums of the groups that carry signal, `forward_backward` + `optim_step`, let the
back-pressure controller observe the step, append the metrics row, save a checkpoint.

Exact resume: every step's randomness is derived from (training.seed, step), the data cursor,
the controller, the adapter and the optimizer are saved after every step, so a resumed run
repeats exactly what an uninterrupted run would have done.

Evaluation (greedy, held-out split): before the first step (logged as
`initial_eval_accuracy` on the step-1 row) and after the update of every `eval_every`-th step
and of the last step (logged as `eval_accuracy` on that step's row).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrain.algorithms.advantages import (
    bounded_for_loss,
    compute_advantages,
    mean_and_std,
    uniform_group_rate,
)
from retrain.backends import create_backend
from retrain.backends.base import (
    AdamParams,
    Backend,
    BackendError,
    BackendOOMError,
    Datum,
    DivergedError,
    LossConfig,
    SamplingParams,
    skipped_nonfinite,
)
from retrain.config.cross_checks import run_name_problem
from retrain.config.sections import Config, run_config
from retrain.control.gradnoise import GradStats, NoiseScale
from retrain.control.stepcost import step_cost
from retrain.control.work import StepWork
from retrain.environments.rollout import (
    RolloutResult,
    Rollouts,
    build_rollouts,
    episode_datum,
    uses_scorer,
)
from retrain.environments.scorer import build_scorer
from retrain.environments.tasks import DataCursor, TaskSplits, load_task, render_prompt
from retrain.errors import UserError
from retrain.run import checkpoint, run_lock
from retrain.run.eval import evaluate, evaluate_episodes
from retrain.run.offpolicy import Overlap
from retrain.run.progress import Progress
from retrain.run.seeds import derive_seed, heldout_episode_seeds
from retrain.run.step_row import logprob_diff, max_rss_mb, ordered, step_work
from retrain.run.stop_request import StopRequest
from retrain.run.trackers import Trackers
from retrain.runfiles import runlog
from retrain.slots.file_slots import slots_from_env

REPORTED_REWARD_ERRORS = 3  # print the first few scorer failures; the rest are only counted
ADVANTAGE_NOTE = "+-65536"  # retrain.algorithms.advantages.LOSS_LIMIT, as the note shows it


def run_single(cfg: Config, config_path: Path, new: bool = False) -> int:
    """Train (or resume) the run described by `cfg`; returns the process exit status."""
    config_path = Path(config_path)
    run_name = cfg.logging.run_name or config_path.stem
    if run_name_problem(run_name):  # a file named `..toml`: its stem names no folder
        raise UserError(f"{config_path}: logging.run_name (the file's stem by default): "
                        f"{run_name_problem(run_name)}")
    run_dir = Path(cfg.logging.log_dir) / run_name
    with run_lock.hold(run_dir):  # a second process on this folder: one line, exit 2
        return _run_locked(cfg, config_path, run_dir, run_name, new)


def _run_locked(cfg: Config, config_path: Path, run_dir: Path, run_name: str,
                new: bool) -> int:
    start = checkpoint.prepare(run_dir, cfg, new=new)
    if start.moved_to is not None:
        print(f"--new: moved the previous run to {start.moved_to}")
    if start.note:
        print(f"{run_dir}: {start.note}")
    if start.finished:
        print(f"{run_dir} already finished {start.state.step} steps; nothing to do "
              "(raise training.max_steps to continue it, or use --new to start over)")
        return 0
    checkpoint.ensure_writable(run_dir)
    config_dir = config_path.resolve().parent
    splits = load_task(cfg.data, cfg.training.seed, config_dir)
    scorer = build_scorer(cfg.reward, config_dir) if uses_scorer(cfg.environment) else None
    slots = slots_from_env()  # the campaign's API semaphore, or a no-op for a standalone run
    backend = create_backend(cfg, slots, config_dir=config_dir,
                             checkpoint_dir=run_dir / runlog.CHECKPOINT_DIR)
    rollouts = None
    try:
        rollouts = build_rollouts(cfg.environment, cfg.data, cfg.reward, cfg.training.seed,
                                  config_dir, backend, scorer, splits.train)
        cfg = run_config(cfg, **{"logging.run_name": run_name})  # config.toml re-runnable
        trainer = Trainer(cfg, run_dir, splits, scorer, backend, slots, config_path, rollouts)
        return trainer.run(start.state, start.fallbacks)
    finally:
        if rollouts is not None:
            rollouts.close()
        if scorer is not None:
            scorer.close()
        backend.close()


@dataclass
class _Sampled:
    """What one attempt at a step produced, before the metrics row is assembled."""

    row: dict
    work: StepWork                       # what the step did, for the back-pressure controller
    errors: list[str] = field(default_factory=list)
    flops: float | None = None           # estimates for the roofline (retrain.control.stepcost)
    bytes_moved: float | None = None
    noise_scale: float | None = None     # gradient noise scale in prompts, for goodput

    @property
    def tokens(self) -> int:
        return self.work.sampled_tokens


class Trainer:
    """Owns the order of the stages; the backend, scorer and controller do the work."""

    def __init__(self, cfg: Config, run_dir: Path, splits: TaskSplits, scorer: Any,
                 backend: Backend, slots: Any, config_path: Path, rollouts: Rollouts):
        from retrain.control.backpressure import BackpressureController

        self.cfg = cfg
        self.training = cfg.training
        self.run_dir = run_dir
        self.splits = splits
        self.scorer = scorer
        self.rollouts = rollouts
        self.backend = backend
        self.slots = slots
        self.config_path = config_path
        self.cursor = DataCursor(len(splits.train), self.training.seed, cfg.data.shuffle)
        self.controller = BackpressureController(cfg.backpressure, self.training.group_size,
                                                 base_batch_size=self.training.batch_size)
        self.noise = NoiseScale()
        self._train_metrics: dict = {}
        self.progress = Progress(cfg.logging.run_name)
        self.stop = StopRequest()
        self.state = runlog.RunState()
        self.batch_size = self.training.batch_size
        self.reward_errors_shown = 0
        self._eval_prompts: list[list[int]] | None = None
        self.overlap = Overlap(backend, run_dir, enabled=self.training.max_steps_off_policy > 0)
        self._in_flight: checkpoint.PendingCommit | None = None  # the last step's checkpoint
        self._api_waited = 0.0         # API waits already counted in a row (api_wait_s)
        self.nonfinite_streak = 0      # steps in a row not applied for a non-finite loss/grad
        self._scaled_noted = False     # advantages were scaled down for the loss (said once)

    # ------------------------------------------------------------------ the run

    def run(self, resume: runlog.RunState | None,
            fallbacks: list[runlog.RunState] | None = None) -> int:
        """Steps until max_steps, an interrupt or an error; returns the exit status.
        `fallbacks`: older resume points, tried when `resume`'s checkpoint does not load."""
        # Restore before writing anything: a resume that fails leaves the folder untouched.
        first = self._restore([resume, *(fallbacks or [])]) if resume else self._fresh()
        checkpoint.write_config(self.run_dir, self.cfg)
        trackers = Trackers(self.cfg, self.run_dir, self.cfg.logging.run_name)
        self.state.status, self.state.pid, self.state.host = "running", os.getpid(), \
            socket.gethostname()
        self.state.started_at = self.state.started_at or time.time()
        self.state.max_steps, self.state.error = self.training.max_steps, ""
        runlog.save_state(self.run_dir, self.state)
        self.stop.install()
        try:
            return self._loop(first, trackers)
        except KeyboardInterrupt:
            return self._interrupted()
        except BackendError as exc:
            self._fail(exc)
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except BaseException as exc:
            full = runlog.disk_full_error(exc, self.run_dir)
            self._fail(full or exc)
            if full is not None:
                raise full from exc  # the CLI turns it into one line
            raise
        finally:
            self.stop.restore()
            self.progress.close()
            trackers.close()

    def _fresh(self) -> int:
        runlog.truncate_metrics(self.run_dir / runlog.METRICS_FILE, 0)
        self.state = runlog.RunState()
        self.batch_size = self.controller.first_batch_size(self.training.batch_size)
        return 1

    def _restore(self, points: list[runlog.RunState]) -> int:
        """Resume from the first point whose checkpoint and saved state load, newest first."""
        failures = []
        for saved in points:
            try:
                self.backend.load_state(saved.checkpoint)
                self.cursor.load_state_dict(saved.data_cursor)
                self.controller.load_state_dict(saved.controller)
                self.noise.load_state_dict(saved.extra.get("grad_noise"))
                streak = saved.extra.get("nonfinite_streak", 0)
                self.nonfinite_streak = streak if isinstance(streak, int) and streak > 0 else 0
                break
            except (BackendError, ValueError, TypeError, KeyError, AttributeError) as exc:
                failures.append(f"{saved.checkpoint!r} ({type(exc).__name__}: {exc})"[:300])
                self.progress.say(f"cannot resume from checkpoint {failures[-1]}")
        else:
            raise UserError(f"{self.run_dir}: cannot resume from any checkpoint: "
                            + "; ".join(failures) + ". Nothing was changed; start over with "
                            "--new (moves this folder aside)")
        dropped = runlog.truncate_metrics(self.run_dir / runlog.METRICS_FILE, saved.step)
        self.state = saved
        # Hand-edited sizes must not make a step take 10**12 prompts: keep the configured range.
        limit = max(self.training.batch_size, self.cfg.backpressure.max_batch_size)
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

    def _loop(self, first: int, trackers: Trackers) -> int:
        self.progress.say(f"run folder: {self.run_dir}")
        if self.backend.summary:
            self.progress.say(f"model: {self.backend.summary}")
        initial = None
        if first == 1 and self._has_eval():
            initial = self._evaluate()
            self.progress.say(f"eval accuracy before training: {initial.accuracy:.3f} "
                              f"({initial.n} held-out problems, {initial.seconds:.1f}s)")
        self.progress.start(self.training.max_steps, first - 1)
        with runlog.MetricsWriter(self.run_dir / runlog.METRICS_FILE) as writer:
            for step in range(first, self.training.max_steps + 1):
                row = self._guarded(step, self._step, step)
                if initial is not None:
                    row["initial_eval_accuracy"] = initial.accuracy
                    initial = None
                self._guarded(step, self._maybe_evaluate, step, row, saved=False)
                self.nonfinite_streak = self.nonfinite_streak + 1 if row["skipped_nonfinite"] \
                    else 0
                stop = self.nonfinite_streak >= self.training.max_nonfinite_steps
                writer.write(row)
                trackers.log(row)
                self.progress.step(row)
                self._commit(step, wait=step == self.training.max_steps
                             or self.stop.signum is not None or stop)
                if stop:
                    raise self._too_many_nonfinite(step)
                if self.progress.output_closed and self.stop.signum is None:
                    self.stop.signum = signal.SIGPIPE  # `retrain ... | head`: the reader left
                if self.stop.signum is not None and step < self.training.max_steps:
                    return self._interrupted()
        self.state.status = "completed"
        runlog.save_state(self.run_dir, self.state)
        self.progress.close()
        self.progress.say(f"finished {self.training.max_steps} steps; adapter: "
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
                   oom_retries=retries)
        # The controller measures the batch size that ran: failed attempts are not its time.
        decision = self.controller.observe(batch_size, sampled.tokens, end - attempt_start,
                                           flops=sampled.flops, bytes_moved=sampled.bytes_moved,
                                           noise_scale=sampled.noise_scale, work=sampled.work)
        self.batch_size = max(1, decision.batch_size)
        if decision.action != "hold" or "rejected" in decision.reason:
            self.progress.say(f"step {step}: back-pressure {decision.action} ({decision.regime}), "
                              f"batch_size {batch_size} -> {decision.batch_size}: "
                              f"{decision.reason}")
        self._report_reward_errors(step, sampled.errors)
        return ordered(row, decision.metrics())

    def _attempt(self, step: int, batch_size: int) -> _Sampled:
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
        self._sample_ahead(step + 1)  # overlap: runs while this step trains
        rewards = result.rewards()
        advantages = compute_advantages(rewards, self.cfg.algorithm.advantage,
                                        self.cfg.algorithm.std_scale)
        advantages, divisor = bounded_for_loss(advantages)  # float32-safe, order kept
        if divisor != 1.0 and not self._scaled_noted:
            self._scaled_noted = True
            self.progress.say(f"step {step}: advantages beyond {ADVANTAGE_NOTE} were divided "
                              f"by {divisor:.3g} before the loss (rewards in large units; "
                              "said once)")
        t2 = time.perf_counter()
        datums = [episode_datum(e, a)
                  for group, adv, dropped in zip(result.groups, advantages, result.dropped,
                                                 strict=True) if not dropped
                  for e, a in zip(group, adv, strict=True) if a != 0.0]
        train = self._train(datums, batch_size)
        t3 = time.perf_counter()
        row = self._row(result, batch_size, rewards, train)
        row.update(sample_time_s=t1 - t0 - result.env_seconds,
                   reward_time_s=t2 - t1 + result.env_seconds, train_time_s=t3 - t2,
                   trained_completions=len(datums),
                   sample_staleness=ahead.staleness if ahead is not None else 0)
        episodes = [e for g in result.groups for e in g]
        work = step_work([[(e.ledger.context_tokens,
                            e.ledger.sampled_tokens) for e in g] for g in result.groups],
                         advantages)
        sampled = _Sampled(row=row, work=work,
                           errors=list(rollout.host.errors)
                           + [f"episode {e.id}: {e.error}" for e in episodes if e.error])
        self._add_estimates(sampled, result, batch_size)
        return sampled

    def _row(self, result: RolloutResult, batch_size: int, rewards: list[list[float]],
             train: dict) -> dict:
        episodes = [e for g in result.groups for e in g]
        n, replies = len(episodes), sum(e.turns for e in episodes)
        flat = [r for g in rewards for r in g]
        mean_reward, reward_std = mean_and_std(flat)  # overflow-safe (1e200 rewards)
        row = {
            "batch_size": batch_size, "group_size": self.training.group_size,
            "num_completions": n, "mean_reward": mean_reward, "reward_std": reward_std,
            "correct_rate": sum(e.success for e in episodes) / n,
            "max_token_hit_rate": sum(e.cut_replies for e in episodes) / max(1, replies),
            "mean_completion_tokens": sum(e.ledger.sampled_tokens for e in episodes) / n,
            **train, "lr": self._lr(batch_size),
            "reward_uniform_group_rate": uniform_group_rate(rewards),
            "reward_failures": self.rollouts.train.host.failures,
        }
        if not uses_scorer(self.cfg.environment):
            row.update(result.metrics())
        return row

    def _take(self, step: int, batch_size: int) -> list[int]:
        """The groups of a step: problem indices from the data cursor (task kind), else
        episode seeds derived from (training.seed, step, group index)."""
        if uses_scorer(self.cfg.environment) or self.cfg.environment.kind == "task":
            return self.cursor.take(batch_size)
        return [derive_seed(self.training.seed, step, f"episode:{g}") for g in range(batch_size)]

    def _lr(self, batch_size: int) -> float:
        """training.lr, scaled for a batch the controller chose ([backpressure] lr_scaling)."""
        bp = self.cfg.backpressure
        if not bp.enabled or bp.lr_scaling == "none":
            return self.training.lr
        ratio = batch_size / self.training.batch_size
        return self.training.lr * (math.sqrt(ratio) if bp.lr_scaling == "sqrt" else ratio)

    def _add_estimates(self, sampled: _Sampled, result: RolloutResult,
                       batch_size: int) -> None:
        """FLOPs and bytes for the roofline; the noise scale in prompts for goodput."""
        metrics = self._train_metrics
        cost = self.backend.cost_model
        if cost is not None:
            est = step_cost(cost, [g[0].ledger.context_tokens
                                   for g in result.groups],
                            [[e.ledger.sampled_tokens for e in g] for g in result.groups],
                            int(metrics.get("tokens", 0)),
                            int(metrics.get("grad_micro_batches", 1)))
            sampled.flops, sampled.bytes_moved = est.flops, est.bytes_moved
        scale, stats = sampled.row.get("grad_noise_scale"), GradStats.from_metrics(metrics)
        if scale is not None and stats is not None:
            sampled.noise_scale = scale / (stats.big_tokens / batch_size)

    def _train(self, datums: list[Datum], batch_size: int) -> dict:
        """forward_backward + optim_step; groups without signal were left out of `datums`."""
        self._train_metrics = {}
        if not datums:  # every group uniform: nothing to learn from this step
            self._land_commit()
            return {"loss": 0.0, "grad_norm": 0.0, "skipped_nonfinite": False,
                    "sampler_trainer_logprob_diff": None,
                    "grad_noise_scale": None, "grad_coherence": None}
        training, alg = self.training, self.cfg.algorithm
        loss = LossConfig(name=alg.loss, clip_eps=alg.clip_eps, clip_eps_high=alg.clip_eps_high,
                          temperature=training.temperature)
        out = self.backend.forward_backward(datums, loss)
        self._train_metrics = out.metrics
        # Measured on the local backend with two or more micro-batches, else None (docs).
        stats = GradStats.from_metrics(out.metrics)
        adam = AdamParams(learning_rate=self._lr(batch_size), beta1=training.beta1,
                          beta2=training.beta2, eps=training.adam_eps,
                          weight_decay=training.weight_decay,
                          grad_clip_norm=training.grad_clip_norm)
        opt = self.backend.optim_step(adam)
        self._land_commit()  # the last step's save landed while this step's update ran
        skipped = skipped_nonfinite(opt.metrics)
        if not skipped:  # a skipped update leaves the weights (and the staleness) as they were
            self.overlap.updated()
        return {"loss": out.loss, "grad_norm": opt.grad_norm, "skipped_nonfinite": skipped,
                "sampler_trainer_logprob_diff": logprob_diff(datums, out.logprobs),
                "grad_noise_scale": self.noise.update(stats),
                "grad_coherence": stats.coherence if stats else None,
                "grad_diagnostics_s": out.metrics.get("grad_diagnostics_s")}

    def _sampling_params(self, step: int) -> SamplingParams:
        training = self.training
        return SamplingParams(max_tokens=training.max_tokens, temperature=training.temperature,
                              top_p=training.top_p, seed=derive_seed(training.seed, step, "sample"),
                              stop_strings=tuple(training.stop))

    def _sample_ahead(self, step: int) -> None:
        """max_steps_off_policy = 1: start sampling `step`'s batch now, before this step's
        update, so it runs while this step trains (see retrain/run/offpolicy.py)."""
        if not self.overlap.enabled or step > self.training.max_steps:
            return
        before = self.cursor.state_dict()
        index = self._take(step, self.batch_size)
        self.overlap.start(step, index, [self._prompt(i) for i in index], self.training.group_size,
                           self._sampling_params(step), before, self.cursor.state_dict())

    def _api_wait_s(self) -> float:
        """Time lost waiting for the API: for a campaign slot, or out a rate limit (429)."""
        return self.slots.wait_s + self.backend.rate_limit_wait_s

    def _prompt(self, index: int) -> list[int]:
        """The turn-0 prompt of a group: a problem index (task kind) or an episode seed."""
        return self.rollouts.train.prompt(index)

    # ------------------------------------------------------------------ eval, checkpoints

    def _has_eval(self) -> bool:
        if self.rollouts.make_eval is None:
            return bool(self.splits.eval)
        return self.cfg.data.eval_size > 0

    def _evaluate(self):
        if self.rollouts.make_eval is not None:  # an environment: held-out episodes
            seeds = heldout_episode_seeds(self.training.seed, self.cfg.data.eval_size)
            return evaluate_episodes(self.rollouts.eval, seeds, self.training.max_tokens,
                                     stop=tuple(self.training.stop))
        if self._eval_prompts is None:
            self._eval_prompts = [render_prompt(self.backend.tokenizer, p, self.cfg.data)
                                  for p in self.splits.eval]
        chunk = max(16, self.training.batch_size * self.training.group_size)
        return evaluate(self.backend, self._eval_prompts, self.splits.eval, self.scorer,
                        self.training.max_tokens, chunk=chunk, stop=tuple(self.training.stop))

    def _maybe_evaluate(self, step: int, row: dict) -> None:
        every, last = self.training.eval_every, self.training.max_steps
        if not self._has_eval() or not (step == last or (every and step % every == 0)):
            return
        result = self._evaluate()
        row["eval_accuracy"] = result.accuracy
        if self.rollouts.make_eval is not None:
            row["eval_mean_reward"] = result.mean_reward
        row["eval_time_s"] = result.seconds
        self.state.extra["eval_accuracy"] = result.accuracy

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
        self.overlap.checkpoint(step, s)  # the batch sampled ahead for step + 1, if any
        self._in_flight = checkpoint.PendingCommit(s, saved)
        if wait or not self.overlap.enabled:
            self._land_commit()

    def _land_commit(self) -> None:
        """Wait for the checkpoint in flight, if any, and point state.json at it."""
        if self._in_flight is not None:
            pending, self._in_flight = self._in_flight, None
            self.state = pending.land(self.run_dir, self.training.save_every,
                                      self.training.max_steps)

    # ------------------------------------------------------------------ endings

    def _interrupted(self) -> int:
        if self.stop.signum == signal.SIGPIPE:
            print("stdout was closed (broken pipe): stopping.", file=sys.stderr, flush=True)
        with contextlib.suppress(BackendError):  # a save that failed leaves the step before
            self._land_commit()
        self.state.status = "interrupted"
        runlog.save_state(self.run_dir, self.state)
        self.progress.close()
        print(f"interrupted after step {self.state.step}/{self.training.max_steps}; checkpoint "
              f"saved. Resume with the same command (e.g. `retrain {self.config_path}`).",
              file=sys.stderr, flush=True)
        return self.stop.exit_code

    def _guarded(self, step: int, call: Any, *args: Any, saved: bool = True) -> Any:
        """`call(*args)` for `step`; a DivergedError becomes the one-line "weights diverged"
        error. `saved`: the weights it samples from are the last checkpoint's (not so for the
        evaluation after an update, which is saved only after it)."""
        try:
            return call(*args)
        except DivergedError as exc:
            raise self._diverged(step, exc, saved) from None

    def _diverged(self, step: int, exc: DivergedError, saved: bool) -> DivergedError:
        """Name the last sound checkpoint. An update that diverged was undone and never
        saved; weights that sample NaN/inf were saved as the last checkpoint, which is moved
        aside (to `diverged-step-N`) so that a resume starts from the one before."""
        with contextlib.suppress(BackendError):
            self._land_commit()
        fix = ("Lower training.lr or training.weight_decay and start over with --new "
               "(resuming as is repeats the divergence)")
        bad = self.state.step
        if not (exc.sampling and saved) or bad < 1:
            return DivergedError(f"weights diverged at step {step}: {exc}. Nothing non-finite "
                                 f"was saved; the last checkpoint is step {bad}'s. {fix}")
        moved = checkpoint.set_aside(self.run_dir, bad)
        points = checkpoint.resume_points(self.run_dir, None)
        self.state = copy.deepcopy(points[0]) if points else runlog.RunState()
        back = f"step {self.state.step}" if points else "the start"
        return DivergedError(f"weights diverged at step {bad}: sampling step {step} met "
                             f"non-finite probabilities. Its checkpoint was moved to {moved}; "
                             f"the run now resumes from {back}, the last checkpoint whose "
                             f"sampling was finite. {fix}")

    def _too_many_nonfinite(self, step: int) -> DivergedError:
        n = self.nonfinite_streak
        return DivergedError(
            f"{n} steps in a row (steps {step - n + 1}-{step}) had a non-finite loss or "
            f"gradient norm and were not applied (training.max_nonfinite_steps = "
            f"{self.training.max_nonfinite_steps}); stopped. The weights are unchanged since "
            f"step {step - n}; checkpoint {self.state.checkpoint} holds them. Check the reward "
            "and lower training.lr, then start over with --new")

    def _fail(self, exc: BaseException) -> None:
        with contextlib.suppress(BackendError):
            self._land_commit()
        self.state.status = "failed"
        self.state.error = f"{type(exc).__name__}: {exc}"[:2000]
        with contextlib.suppress(OSError):  # the original error matters more
            runlog.save_state_even_if_full(self.run_dir, self.state)

    def _report_reward_errors(self, step: int, errors: list[str]) -> None:
        if errors and self.reward_errors_shown < REPORTED_REWARD_ERRORS:
            self.reward_errors_shown += 1
            more = "" if self.reward_errors_shown < REPORTED_REWARD_ERRORS else \
                (" (further failures are only counted in reward_failures)"
                 if uses_scorer(self.cfg.environment) else
                 " (further failures are only counted in env_errors)")
            what = "reward function" if uses_scorer(self.cfg.environment) else "environment"
            self.progress.say(f"step {step}: {what} failed: {errors[0]}{more}")

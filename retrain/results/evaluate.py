"""`retrain eval RUN_DIR`: a checkpoint's accuracy on a prompt source, with its interval.

Greedy by default, exactly as the trainer evaluates (same prompts, batches, max_tokens and
scorer), so on the run's own held-out split it reproduces the run's `eval_accuracy` at that
step. A run whose environment plays episodes (any kind but a plain `task`) is evaluated on its
held-out episodes, as the trainer does: accuracy is then the success rate.
`--samples K` (at --temperature T, default the run's training.eval_temperature) samples K
completions per prompt, seeded and batched as the trainer's eval_samples are (run/eval.py), and
reports the rows' figures: eval_mean_at_k (mean@K, an unbiased pass@1) with its standard error
and interval, and eval_pass_at_k.
Every completion (or episode) goes to RUN_DIR/evals/<name>-step<N>.jsonl (name: heldout, the
task, or a --data file's stem and a hash of its path); nothing else in the run folder is
touched.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from retrain.config.sections import Config, ConfigError
from retrain.config.sections import run_config as changed_config
from retrain.environments.answers import Problem
from retrain.errors import UserError
from retrain.results import run_checkpoint
from retrain.results.stats import CONFIDENCE, Estimate, estimate, mean
from retrain.run.at_k import at_k
from retrain.runfiles import runlog

EVALS_DIR = "evals"
MAX_SAMPLES = 1024  # --samples: every completion is kept for the evals file (serve caps too)
BUILT_IN_TASKS = ("arithmetic", "countdown")


@dataclass(frozen=True)
class EvalRequest:
    step: int | None = None
    data: Path | None = None        # a JSONL file of {"prompt", "answer"} lines
    task: str | None = None         # a built-in task's held-out split
    reward: str | None = None       # [reward].type for this eval
    samples: int = 1                # completions per prompt (1 = greedy unless temperature)
    temperature: float | None = None


@dataclass
class Proportion:
    """k of n, with its exact (Clopper-Pearson) 95% interval."""

    k: int
    n: int
    value: float
    lo: float
    hi: float


@dataclass
class EvalReport:
    run_dir: str
    step: int
    source: str
    problems: int
    samples: int
    temperature: float
    reward: str
    accuracy: Proportion            # greedy: correct completions; sampled: pass@K
    mean_reward: float
    pass_at_1: Estimate | None      # sampled only: mean per-problem rate, t interval
    file: str
    unit: str = "problems"          # "episodes" for an environment's held-out episodes
    # sampled only, named as the trainer's rows name them (docs/training.md)
    eval_mean_at_k: float | None = None
    eval_pass_at_k: float | None = None
    eval_mean_at_k_se: float | None = None


def binomial(k: int, n: int) -> Proportion:
    from scipy import stats

    ci = stats.binomtest(k, n).proportion_ci(CONFIDENCE, method="exact")
    return Proportion(k, n, k / n, float(ci.low), float(ci.high))


def _check(req: EvalRequest) -> None:
    if req.data is not None and req.task is not None:
        raise UserError("give --data FILE.jsonl or --task NAME, not both")
    if req.task is not None and req.task not in BUILT_IN_TASKS:
        raise UserError(f"--task {req.task!r}: not a built-in task; use "
                        f"{' or '.join(BUILT_IN_TASKS)}, or --data FILE.jsonl")
    if not 1 <= req.samples <= MAX_SAMPLES:
        raise UserError(f"--samples {req.samples}: give a number from 1 to {MAX_SAMPLES}")
    if req.temperature is not None and not (0 <= req.temperature <= 10):
        raise UserError(f"--temperature {req.temperature}: give a value in [0, 10]")
    if req.samples > 1 and req.temperature == 0:
        raise UserError("--samples > 1 needs --temperature > 0 (greedy gives one answer)")


def _eval_config(cfg: Config, req: EvalRequest) -> Config:
    changes: dict = {}
    if req.reward is not None:
        changes["reward.type"] = req.reward
    if req.task is not None:
        changes["data.source"] = req.task
        if cfg.data.eval_size == 0:
            changes["data.eval_size"] = 64
    try:
        return changed_config(cfg, **changes) if changes else cfg
    except ConfigError as exc:
        flag = "--reward" if req.reward is not None else "--task"
        raise UserError(f"{flag}: {exc}") from None


def _problems(cfg: Config, req: EvalRequest, run_dir: Path) -> tuple[str, list[Problem]]:
    from retrain.environments.tasks import load_task, read_jsonl

    if req.data is not None:
        return Path(req.data).stem, read_jsonl(Path(req.data))
    held = load_task(cfg.data, cfg.training.seed, run_dir).eval
    name = req.task or "heldout"
    if not held:
        raise UserError(f"{run_dir}: the run has no held-out split (data.eval_size = 0); give "
                        "--data FILE.jsonl or --task NAME")
    return name, held


def evaluate(run_dir: Path, req: EvalRequest) -> EvalReport:
    """Run the evaluation described by `req` and write its evals/ file."""
    run_dir = run_checkpoint.check_run_dir(run_dir)
    _check(req)
    cfg = _eval_config(run_checkpoint.run_config(run_dir), req)
    with run_checkpoint.held(run_dir, req.step) as ckpt:
        return _evaluate(cfg, ckpt, run_dir, req)


def _evaluate(cfg: Config, ckpt: run_checkpoint.Checkpoint, run_dir: Path,
              req: EvalRequest) -> EvalReport:
    from retrain.run.eval import eval_temperature

    temperature = 0.0 if req.temperature is None and req.samples == 1 else \
        req.temperature if req.temperature is not None else eval_temperature(cfg.training)
    k = req.samples
    if req.data is None and req.task is None and plays_episodes(cfg):
        name, unit, scorer_name = "heldout", "episodes", f"environment {cfg.environment.kind}"
        groups = _play_episodes(cfg, ckpt, run_dir, k, temperature)
        records = _episode_records(groups)
        correct = [e.success for g in groups for e in g]
        rewards = [e.reward for g in groups for e in g]
    else:
        name, problems = _problems(cfg, req, run_dir)
        unit, scorer_name = "problems", cfg.reward.type
        source = f"--data {req.data}" if req.data is not None else \
            f"--task {req.task}" if req.task is not None else "the held-out split"
        texts, scores = _complete_and_score(cfg, ckpt, run_dir, problems, k, temperature,
                                            source)
        records = _records(cfg, problems, texts, scores)
        correct, rewards = scores.correct, scores.rewards
    label = f"{_file_name(name, req)}-step{ckpt.step}" + (
        f"-k{k}-t{temperature:g}" if temperature > 0 else "")
    out = run_dir / EVALS_DIR / f"{label}.jsonl"
    _write(out, records)
    n = len(correct) // k
    per_problem = [sum(correct[i * k:(i + 1) * k]) for i in range(n)]
    report = EvalReport(run_dir=str(run_dir), step=ckpt.step, source=name, problems=n,
                        samples=k, temperature=temperature, reward=scorer_name,
                        accuracy=binomial(sum(1 for c in per_problem if c), n),
                        mean_reward=mean(rewards), pass_at_1=None, file=str(out), unit=unit)
    if k > 1:
        report.pass_at_1 = estimate([c / k for c in per_problem])
        sampled = at_k([[bool(c) for c in correct[i * k:(i + 1) * k]] for i in range(n)])
        report.eval_mean_at_k, report.eval_pass_at_k = sampled.mean_at_k, sampled.pass_at_k
        report.eval_mean_at_k_se = sampled.mean_at_k_se
    return report


def _file_name(name: str, req: EvalRequest) -> str:
    """The evals/ file's name: a --data file's stem plus a short hash of its resolved path, so
    that a/x.jsonl and b/x.jsonl never overwrite each other's results."""
    if req.data is None:
        return name
    digest = hashlib.sha256(str(Path(req.data).resolve()).encode("utf-8", "surrogateescape"))
    return f"{name}-{digest.hexdigest()[:8]}"


def plays_episodes(cfg: Config) -> bool:
    """The run's environment plays episodes in a worker (held-out episodes, not prompts)."""
    from retrain.environments.rollout import uses_scorer

    return not uses_scorer(cfg.environment)


class _OneBatch:
    """The policy as the rollout's backend: each turn's prompts in one batched decode, as the
    trainer's local backend samples them, so greedy episodes match the run's own eval;
    `rows` (sampled episodes): at most that many rows per decode instead."""

    def __init__(self, policy, rows: int | None = None):
        self.policy, self.tokenizer, self.rows = policy, policy.tokenizer, rows
        self.max_context = policy.max_context

    def sample(self, prompts, n, params):
        if self.rows is None:
            return self.policy.sample(prompts, n, params, chunk=max(1, len(prompts)))
        return _bounded_sample(self.policy, prompts, n, params, self.rows)


def _bounded_sample(policy, prompts: list[list[int]], n: int, params, rows: int):
    """`n` completions per prompt as the trainer's sampled eval draws them (`sample_k`): one
    batched decode of at most `rows` rows a call."""
    from retrain.run.eval import sample_k

    def one_decode(some, m, p):
        return policy.sample(some, m, p, chunk=max(1, len(some)))

    return sample_k(one_decode, prompts, n, params, rows)


def _play_episodes(cfg: Config, ckpt: run_checkpoint.Checkpoint, run_dir: Path, k: int,
                   temperature: float):
    """`k` episodes per held-out seed (the trainer's seeds), played by the checkpoint."""
    from retrain.environments.rollout import build_rollouts
    from retrain.run.seeds import heldout_episode_seeds

    if cfg.data.eval_size == 0:
        raise UserError(f"{run_dir}: the run has no held-out episodes (data.eval_size = 0); "
                        "give --data FILE.jsonl or --task NAME to evaluate on prompts")
    policy = load_policy(cfg, ckpt, run_dir)
    rollouts = None
    try:
        rows = None if k == 1 else _rows(cfg)
        rollouts = build_rollouts(cfg.environment, cfg.data, cfg.reward, cfg.training.seed,
                                  run_dir, _OneBatch(policy, rows), scorer=None, problems=[])
        params = _params(cfg, temperature)
        seeds = heldout_episode_seeds(cfg.training.seed, cfg.data.eval_size)
        return rollouts.eval.run(seeds, k, params).groups
    finally:
        if rollouts is not None:
            rollouts.close()
        policy.close()


def _episode_records(groups) -> list[dict]:
    """One evals/ line per episode: its messages, how it ended and its reward."""
    k = len(groups[0]) if groups else 1
    return [{"seed": e.seed, "messages": e.history, "reward": e.reward, "correct": e.success,
             "turns": e.turns, "ended": e.ended, **({"error": e.error} if e.error else {}),
             **({"sample": j} if k > 1 else {})}
            for g in groups for j, e in enumerate(g)]


def _complete_and_score(cfg: Config, ckpt: run_checkpoint.Checkpoint, run_dir: Path,
                        problems: list[Problem], k: int, temperature: float, source: str):
    """(k completion texts per problem, their Scores, flat in problem order), sampled as the
    trainer's evaluation samples: same prompts, max_tokens and batches."""
    from retrain.environments.scorer import build_scorer
    from retrain.environments.tasks import render_prompt

    scorer = build_scorer(cfg.reward, run_dir)
    policy = None
    try:
        policy = load_policy(cfg, ckpt, run_dir)
        prompts = [render_prompt(policy.tokenizer, p, cfg.data) for p in problems]
        params = _params(cfg, temperature)
        _check_context(prompts, params.max_tokens, policy.max_context, source)
        groups = policy.sample(prompts, 1, params, chunk=_rows(cfg)) if k == 1 else \
            _bounded_sample(policy, prompts, k, params, _rows(cfg))
        texts = [[policy.tokenizer.decode(c.tokens, skip_special_tokens=True) for c in g]
                 for g in groups]
        scores = scorer.score([t for g in texts for t in g], [p for p in problems
                                                              for _ in range(k)])
        return texts, scores
    finally:
        scorer.close()
        if policy is not None:
            policy.close()


def _params(cfg: Config, temperature: float):
    """Greedy as the trainer's eval, or its sampled eval's seeded params (run/eval.py)."""
    from retrain.backends.base import SamplingParams
    from retrain.run.eval import sampled_params

    if temperature > 0:
        return sampled_params(cfg.training, temperature)
    return SamplingParams(max_tokens=cfg.training.max_tokens, temperature=0.0,
                          stop_strings=tuple(cfg.training.stop))


def _rows(cfg: Config) -> int:
    """Completions per batched decode: a training step's (the trainer's eval batches)."""
    return max(16, cfg.training.batch_size * cfg.training.group_size)


def _check_context(prompts: list[list[int]], max_tokens: int, max_context: int | None,
                   source: str) -> None:
    """Refuse, before sampling, a problem whose prompt + max_tokens passes the context."""
    from retrain.backends.base import context_overflow

    for i, p in enumerate(prompts):
        why = context_overflow(len(p), max_tokens, max_context)
        if why:
            raise UserError(f"{source}: problem {i + 1}: {why} (training.max_tokens of the "
                            "run); shorten that problem")


def _records(cfg: Config, problems: list[Problem], texts: list[list[str]],
             scores) -> list[dict]:
    """One evals/ line per completion."""
    from retrain.environments.tasks import prompt_text

    k = len(texts[0]) if texts else 1
    return [{"prompt": prompt_text(p, cfg.data), "completion": t, "answer": p.answer,
             "reward": scores.rewards[i * k + j], "correct": scores.correct[i * k + j],
             **({"sample": j} if k > 1 else {})}
            for i, (p, g) in enumerate(zip(problems, texts, strict=True))
            for j, t in enumerate(g)]


def load_policy(cfg: Config, ckpt: run_checkpoint.Checkpoint, run_dir: Path):
    """Something with `.tokenizer` and `.sample(prompts, n, params, chunk=)`."""
    if ckpt.is_tinker:
        from retrain.results.tinker_policy import TinkerPolicy

        return TinkerPolicy.load(cfg, ckpt)
    from retrain.results.policy import LocalPolicy

    return LocalPolicy.load(cfg, ckpt, run_dir)


def _write(path: Path, records: list[dict]) -> None:
    data = "".join(json.dumps(runlog.json_safe(r), ensure_ascii=False) + "\n" for r in records)
    path.parent.mkdir(parents=True, exist_ok=True)
    runlog.replace_atomically(path, data.encode("utf-8"))


def summary_lines(r: EvalReport) -> list[str]:
    a = r.accuracy
    interval = f"[{a.lo:.3f}, {a.hi:.3f}]"
    if r.samples == 1:
        how = "greedy" if r.temperature == 0 else f"1 sample at temperature {r.temperature:g}"
        what = "successful episodes" if r.unit == "episodes" else "correct"
        lines = [f"{r.source} at step {r.step}: accuracy {a.value:.3f} {interval} "
                 f"({a.k}/{a.n} {what}, {how}; exact binomial 95% interval)"]
    else:
        p1, k = r.pass_at_1, r.samples
        se = f" ± {r.eval_mean_at_k_se:.3f} (standard error)" \
            if r.eval_mean_at_k_se is not None else ""
        lines = [f"{r.source} at step {r.step}: pass@{k} {a.value:.3f} {interval} "
                 f"({a.k}/{a.n} {r.unit} solved by some sample; exact binomial 95% interval)",
                 f"mean@{k} {p1.mean:.3f}{se} [{p1.lo:.3f}, {p1.hi:.3f}] (an unbiased pass@1: "
                 f"{k} samples per {r.unit[:-1]} at temperature {r.temperature:g}; t interval "
                 "over problems)" if p1 and p1.lo is not None
                 else f"mean@{k} {p1.mean:.3f}" if p1 else ""]
    what = "episodes" if r.unit == "episodes" else "completions"
    lines.append(f"mean reward {r.mean_reward:.3f} ({r.reward}); {what}: {r.file}")
    return [line for line in lines if line]


def show(run_dir: Path, req: EvalRequest, as_json: bool = False) -> None:
    report = evaluate(run_dir, req)
    if as_json:
        from retrain.cli import render

        print(render.dump_json(asdict(report)))
    else:
        print("\n".join(summary_lines(report)))

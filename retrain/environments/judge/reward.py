"""`[reward] type = "judge"`: completions scored by an LLM behind an OpenAI-compatible URL.

`JudgeScorer` has the Scorer's interface (`score(texts, problems) -> Scores`, `close()`), so
the rollout and the held-out eval use it unchanged. Pointwise mode sends one request per
completion; group mode one request per prompt with all its completions (the rollout passes a
group's completions next to each other). Requests run `max_concurrent` at a time. A reply
with no readable score, or no reply after the retries, scores 0 and is counted
(`judge_parse_errors`, `judge_errors`); `score()` raises only once `max_failed_steps`
calls in a row had every request fail (a UserError: the run stops in one line). That streak
is part of the run's resume point (`state_dict`), so a resumed run continues it.

Scores are cached in the run folder (`judge_cache.jsonl`, one line per answer, keyed by a
hash of the mode, model, rubric, prompt, answer and completion(s)): a resumed run replays its
unfinished step without paying for the answers it already has. Unreadable answers are not
cached, so a resume asks again.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrain.config.judge_section import JudgeConfig, judge_config
from retrain.config.sections import RewardConfig
from retrain.environments.answers import Problem, is_correct
from retrain.environments.chat_problems import problem_key
from retrain.environments.judge.client import JudgeClient
from retrain.environments.judge.prompt import (
    group_request,
    parse_group,
    parse_score,
    pointwise_request,
)
from retrain.environments.rewards import MAX_ERRORS_KEPT, Scores
from retrain.errors import UserError
from retrain.runfiles import safejson

CACHE_FILE = "judge_cache.jsonl"
METRICS = ("judge_calls", "judge_errors", "judge_parse_errors", "judge_seconds",
           "judge_cache_hits", "judge_input_tokens", "judge_output_tokens")


class JudgeCache:
    """Answers by key, read from and appended to a JSONL file (None: memory only). A line that
    is not a key with scores the judge could have given (torn by a kill mid-write, or edited:
    a score that is not a finite number in [0, 1]) is skipped, so that answer is asked again."""

    def __init__(self, path: Path | None):
        self.path, self._lock, self._items = path, threading.Lock(), {}
        self._torn = False  # the file's last line has no newline: the next append starts one
        if path is not None and path.is_file():
            raw = path.read_bytes()
            self._torn = bool(raw) and not raw.endswith(b"\n")
            for line in raw.split(b"\n"):
                item = _cached_item(line)
                if item is not None:
                    self._items[item[0]] = item[1]

    def get(self, key: str) -> list[float] | None:
        return self._items.get(key)

    def put(self, key: str, scores: list[float]) -> None:
        with self._lock:
            self._items[key] = scores
            if self.path is not None:
                line = json.dumps({"key": key, "scores": scores}) + "\n"
                with self.path.open("a", encoding="utf-8") as f:
                    f.write("\n" + line if self._torn else line)
                self._torn = False


def _cached_item(line: bytes) -> tuple[str, list[float]] | None:
    """(key, scores) of one cache line; None for a line the judge cannot have written."""
    try:
        item = safejson.loads(line)  # NaN and Infinity read as None; huge integers fail
    except ValueError:
        return None
    if not isinstance(item, dict) or not isinstance(item.get("key"), str):
        return None
    scores = item.get("scores")
    if not isinstance(scores, list) or not scores or not all(_a_score(s) for s in scores):
        return None
    return item["key"], [float(s) for s in scores]


def _a_score(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and 0.0 <= value <= 1.0


@dataclass
class _Tally:
    calls: int = 0
    errors: int = 0
    parse_errors: int = 0
    cache_hits: int = 0
    input_tokens: int = 0   # the judge API's `usage`, summed over the call's requests
    output_tokens: int = 0
    messages: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, message: str, parse: bool) -> None:
        with self.lock:
            if parse:
                self.parse_errors += 1
            else:
                self.errors += 1
            if len(self.messages) < MAX_ERRORS_KEPT:
                self.messages.append(message)


def rubric_text(cfg: JudgeConfig, config_dir: Path) -> str:
    if not cfg.rubric_file:
        return cfg.rubric
    path = Path(cfg.rubric_file).expanduser()
    path = path if path.is_absolute() else config_dir / path
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"reward.judge.rubric_file: {path} cannot be read: {exc}") from None


class JudgeScorer:
    """Scores completions with the judge; `probe` at build time fails an unreachable judge."""

    def __init__(self, reward: RewardConfig, config_dir: Path, run_dir: Path | None = None,
                 slot: Any = None):
        self.cfg = judge_config(reward)
        self.rubric = rubric_text(self.cfg, Path(config_dir))
        self.client = JudgeClient(self.cfg, slot)
        self.client.probe()
        self.cache = JudgeCache(Path(run_dir) / CACHE_FILE if run_dir is not None else None)
        self._pool = ThreadPoolExecutor(self.cfg.max_concurrent, thread_name_prefix="judge")
        self.failed_streak = 0  # score() calls in a row in which every request failed

    def score(self, texts: list[str], problems: list[Problem]) -> Scores:
        if len(texts) != len(problems):
            raise ValueError(f"{len(texts)} texts but {len(problems)} problems")
        start, tally = time.perf_counter(), _Tally()
        batches = _batches(problems) if self.cfg.mode == "group" else \
            [[i] for i in range(len(texts))]
        rewards = [0.0] * len(texts)
        jobs = [self._pool.submit(self._score_batch, [texts[i] for i in b], problems[b[0]],
                                  tally) for b in batches]
        for batch, job in zip(batches, jobs, strict=True):
            for i, value in zip(batch, job.result(), strict=True):
                rewards[i] = value
        out = Scores(rewards=rewards,
                     correct=[is_correct(t, p) for t, p in zip(texts, problems, strict=True)],
                     failures=tally.errors + tally.parse_errors, errors=tally.messages)
        out.metrics = {"judge_calls": tally.calls, "judge_errors": tally.errors,
                       "judge_parse_errors": tally.parse_errors,
                       "judge_seconds": time.perf_counter() - start,
                       "judge_cache_hits": tally.cache_hits,
                       "judge_input_tokens": tally.input_tokens,
                       "judge_output_tokens": tally.output_tokens}
        if batches:
            self._count_failures(tally.errors == len(batches), tally.messages)
        return out

    def _count_failures(self, all_failed: bool, messages: list[str]) -> None:
        """A UserError once `max_failed_steps` calls in a row had every request fail: a judge
        that answers nothing (a wrong route, a model it does not serve, an outage) must not
        let the run "finish" having learned nothing."""
        self.failed_streak = self.failed_streak + 1 if all_failed else 0
        limit = self.cfg.max_failed_steps
        if self.failed_streak >= limit:
            last = messages[-1] if messages else "no answer"
            raise UserError(f"reward.judge: every judge request failed in {self.failed_streak} "
                            f"steps in a row ({last}); check that the judge at "
                            f"{self.cfg.base_url} serves {self.cfg.model!r}, then resume with "
                            "the same command (reward.judge.max_failed_steps = "
                            f"{limit} allows that many)")

    def state_dict(self) -> dict:
        """What a resume point keeps: the failed streak, so a resume cannot reset it."""
        return {"failed_streak": self.failed_streak}

    def load_state_dict(self, state: dict | None) -> None:
        streak = (state or {}).get("failed_streak", 0)  # a hand-edited value counts as 0
        self.failed_streak = streak if type(streak) is int and streak > 0 else 0

    def _score_batch(self, texts: list[str], problem: Problem, tally: _Tally) -> list[float]:
        """Scores of one request's completions (one, or a whole group); zeros on failure."""
        key = self._key(texts, problem)
        cached = self.cache.get(key)
        if cached is not None and len(cached) == len(texts):
            with tally.lock:
                tally.cache_hits += len(texts)
            return cached
        group = self.cfg.mode == "group"
        request = (group_request if group else _pointwise)(self.rubric, problem.prompt,
                                                           texts, problem.answer)
        answer = self.client.ask(request)
        with tally.lock:
            tally.calls += answer.calls
            tally.input_tokens += answer.input_tokens
            tally.output_tokens += answer.output_tokens
        if answer.text is None:
            tally.fail(f"judge request failed: {answer.error}", parse=False)
            return [0.0] * len(texts)
        scores = parse_group(answer.text, len(texts)) if group else \
            _listed(parse_score(answer.text))
        if scores is None:
            tally.fail(f"judge reply has no readable score: {answer.text[:120]!r}", parse=True)
            return [0.0] * len(texts)
        self.cache.put(key, scores)
        return scores

    def _key(self, texts: list[str], problem: Problem) -> str:
        parts = [self.cfg.mode, self.cfg.model, self.rubric, repr(problem_key(problem)),
                 problem.answer, *texts]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def close(self) -> None:
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
            self.client.close()


def _pointwise(rubric: str, prompt: str, texts: list[str], answer: str) -> str:
    return pointwise_request(rubric, prompt, texts[0], answer)


def _listed(score: float | None) -> list[float] | None:
    return None if score is None else [score]


def _batches(problems: list[Problem]) -> list[list[int]]:
    """Runs of consecutive completions of the same problem: one group request each."""
    out: list[list[int]] = []
    for i, p in enumerate(problems):
        if out and _same(problems[out[-1][0]], p):
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _same(a: Problem, b: Problem) -> bool:
    return a is b or (problem_key(a) == problem_key(b) and a.answer == b.answer)

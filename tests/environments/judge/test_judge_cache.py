"""The judge's cache (judge_cache.jsonl) read back by a resumed run, against a real HTTP judge
(tests/judge_server.py): a cached score the judge could not have given is skipped as a torn
line is (that answer is asked again), and an append after a torn last line starts a line."""

from __future__ import annotations

import hashlib
import json

import pytest

from retrain.config.sections import RewardConfig, from_dict
from retrain.environments.answers import Problem
from retrain.environments.judge.reward import CACHE_FILE, JudgeCache, JudgeScorer
from tests.judge_server import RUBRIC, JudgeServer, pointwise_score

TEXTS = ["7", "it is 7", "eight"]
PROBLEM = Problem(prompt="What is 3 + 4?", answer="7")


@pytest.fixture
def server():
    s = JudgeServer()
    yield s
    s.close()


def reward(server: JudgeServer) -> RewardConfig:
    table = {"base_url": server.base_url, "model": "judge", "rubric": RUBRIC, "retries": 0,
             "timeout_s": 10.0}
    return from_dict({"reward": {"type": "judge", "judge": table}}).reward


def judged(server, run_dir, texts=TEXTS):
    scorer = JudgeScorer(reward(server), run_dir, run_dir)
    try:
        return scorer.score(texts, [PROBLEM] * len(texts))
    finally:
        scorer.close()


def cache_lines(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / CACHE_FILE).read_text().splitlines()]


@pytest.mark.parametrize("scores", [
    ["x"], [7.0], [-3], [1.5], [True], [None], [], "0.5", {"a": 0.5}, [[0.5]],
    ["NaN"], [10 ** 400],
], ids=["text", "7.0", "-3", "1.5", "true", "null", "empty", "string", "object", "nested",
        "NaN-text", "huge-int"])
def test_a_cached_score_outside_the_judges_range_is_asked_again(tmp_path, server, scores):
    first = judged(server, tmp_path)
    assert first.metrics["judge_calls"] == 3
    lines = cache_lines(tmp_path)
    hostile = [dict(lines[0], scores=scores), *lines[1:]]
    (tmp_path / CACHE_FILE).write_text("".join(json.dumps(x) + "\n" for x in hostile))
    again = judged(server, tmp_path)
    assert again.rewards == first.rewards == [pointwise_score(t) for t in TEXTS]
    assert again.metrics["judge_cache_hits"] == 2 and again.metrics["judge_calls"] == 1
    assert all(0.0 <= r <= 1.0 for r in again.rewards)


def test_non_finite_and_non_json_lines_are_skipped(tmp_path):
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(5)]
    (tmp_path / CACHE_FILE).write_text(
        f'{{"key": "{keys[0]}", "scores": [NaN]}}\n'
        f'{{"key": "{keys[1]}", "scores": [Infinity]}}\n'
        f'{{"key": "{keys[2]}", "scores": [1e999]}}\n'
        f'["{keys[3]}", [0.5]]\n'
        f'{{"key": "{keys[4]}", "scores": [0, 1, 0.25]}}\n')
    cache = JudgeCache(tmp_path / CACHE_FILE)
    assert [cache.get(k) for k in keys] == [None, None, None, None, [0.0, 1.0, 0.25]]


def test_an_append_after_a_torn_last_line_starts_a_new_line(tmp_path, server):
    judged(server, tmp_path, TEXTS[:2])
    whole = (tmp_path / CACHE_FILE).read_text()
    (tmp_path / CACHE_FILE).write_text(whole + whole.splitlines()[0][:30])  # killed mid-write
    judged(server, tmp_path, TEXTS)  # two cached, the third appended
    text = (tmp_path / CACHE_FILE).read_text()
    assert text.endswith("\n") and len(text.splitlines()) == 4
    assert json.loads(text.splitlines()[-1])["scores"] == [pointwise_score(TEXTS[2])]
    before = server.requests
    assert judged(server, tmp_path).metrics["judge_cache_hits"] == 3  # all three read back
    assert server.requests == before

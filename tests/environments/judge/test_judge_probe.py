"""A judge that cannot serve the run is found before it trains, against a real HTTP judge
(tests/judge_server.py): a base_url without /v1 and a model the judge does not serve stop the
start-up probe in one line (a judge without /models, or one that takes any name as llama.cpp's
server does, still passes), and `max_failed_steps` steps in a row in which every judge request
failed stop the run in one line, resumable once the judge answers again."""

from __future__ import annotations

import pytest

from retrain.config.sections import RewardConfig, from_dict
from retrain.environments.answers import Problem
from retrain.environments.judge.reward import JudgeScorer
from retrain.errors import UserError
from tests.judge_server import RUBRIC, JudgeServer
from tests.run_helpers import rows, run_in_process, state, write_config

TEXTS, PROBLEMS = ["7", "seven"], [Problem(prompt="What is 3 + 4?", answer="7")] * 2


@pytest.fixture
def server():
    s = JudgeServer()
    yield s
    s.close()


def reward(base_url: str, **judge) -> RewardConfig:
    table = {"base_url": base_url, "model": "judge", "rubric": RUBRIC, "retries": 0,
             "timeout_s": 10.0, **judge}
    return from_dict({"reward": {"type": "judge", "judge": table}}).reward


def probe_error(cfg: RewardConfig, tmp_path) -> str:
    with pytest.raises(UserError) as err:
        JudgeScorer(cfg, tmp_path, None)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_a_base_url_without_v1_stops_the_probe(server, tmp_path):
    root = server.base_url.removesuffix("/v1")
    message = probe_error(reward(root), tmp_path)
    assert message.startswith(f"reward.judge.base_url = {root}: HTTP 404 at {root}/models and "
                              f"at {root}/chat/completions")
    assert f"it usually ends in /v1: {root}/v1" in message
    assert server.requests == 0  # nothing reached the judge's route


def test_a_model_the_judge_does_not_serve_stops_the_probe(server, tmp_path):
    server.models = ["judge", "judge-large"]
    message = probe_error(reward(server.base_url, model="jugde"), tmp_path)
    assert message.startswith(f"reward.judge.model = 'jugde': the judge at {server.base_url} "
                              "does not serve it (HTTP 404: ")
    assert "it lists 'judge', 'judge-large': set reward.judge.model to one of them" in message
    assert server.requests == 1  # the probe's one-token request


@pytest.mark.parametrize("case", ["listed", "no /models", "any name"])
def test_a_judge_that_answers_passes_the_probe(server, tmp_path, case):
    model = "judge"
    if case == "no /models":
        server.models = None
    if case == "any name":  # listed under its file name, answers whatever it is called
        server.models, server.any_model, model = ["/models/judge.gguf"], True, "qwen"
    scorer = JudgeScorer(reward(server.base_url, model=model), tmp_path, None)
    try:
        assert scorer.score(TEXTS, PROBLEMS).metrics["judge_errors"] == 0
    finally:
        scorer.close()
    assert server.requests == (2 if case == "listed" else 3)  # + the probe's request


def test_steps_in_a_row_with_every_request_failed_raise_one_line(server, tmp_path):
    scorer = JudgeScorer(reward(server.base_url, max_failed_steps=2), tmp_path, None)
    try:
        server.mode = "429"
        assert scorer.score(TEXTS, PROBLEMS).rewards == [0.0, 0.0]
        server.mode = "score"
        scorer.score(["8", "eight"], PROBLEMS)  # one answered step resets the count
        scorer.score(TEXTS[:1], PROBLEMS[:1])
        server.mode = "429"
        scorer.score(["6", "six", "7"], PROBLEMS + PROBLEMS[:1])  # one cached: not all failed
        scorer.score(["6", "six"], PROBLEMS)
        with pytest.raises(UserError) as err:
            scorer.score(["9", "nine"], PROBLEMS)
    finally:
        scorer.close()
    message = str(err.value)
    assert message.startswith("reward.judge: every judge request failed in 2 steps in a row "
                              "(judge request failed: HTTP 429")
    assert "reward.judge.max_failed_steps = 2" in message and "\n" not in message


def judged_run(tmp_path, base_url: str, max_steps: int = 3, **judge):
    table = {"base_url": base_url, "model": "judge", "rubric": RUBRIC, "retries": 0,
             "timeout_s": 10.0, **judge}
    return write_config(tmp_path, "judged", reward={"type": "judge", "judge": table},
                        data={"source": "arithmetic", "eval_size": 0},
                        training={"max_steps": max_steps, "save_every": 1})


def test_a_run_without_v1_stops_at_start(tmp_path, server):
    path = judged_run(tmp_path, server.base_url.removesuffix("/v1"))
    done = run_in_process([path.name], tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "reward.judge.base_url = " in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "logs" / "judged" / "metrics.jsonl").exists()


def test_a_run_whose_judge_fails_every_request_stops_and_resumes(tmp_path, tiny_model, server):
    server.mode = "429"  # an outage from the first step on
    path = judged_run(tmp_path, server.base_url, max_failed_steps=2)
    done = run_in_process([path.name], tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if "reward.judge:" in line]
    assert len(errors) == 1 and "every judge request failed in 2 steps in a row" in errors[0]
    assert "Traceback" not in done.stderr
    run_dir = tmp_path / "logs" / "judged"
    assert [r["step"] for r in rows(run_dir)] == [1]  # step 2 stopped before it trained
    assert state(run_dir)["status"] == "failed" and state(run_dir)["step"] == 1
    server.mode = "score"  # the judge is back: the same command resumes
    done = run_in_process([path.name], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3]
    assert all(r["judge_errors"] == 0 for r in rows(run_dir)[1:])


def test_the_failed_streak_goes_on_across_a_resume(tmp_path, tiny_model, server):
    """Two failed steps finish a 2-step run; raised to 4 steps, the resume's first failed step
    is the third in a row and stops the run (a streak restarted at 0 would finish it)."""
    server.mode = "429"
    path = judged_run(tmp_path, server.base_url, 2, max_failed_steps=3)
    done = run_in_process([path.name], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = tmp_path / "logs" / "judged"
    assert state(run_dir)["extra"]["scorer"] == {"failed_streak": 2}
    judged_run(tmp_path, server.base_url, 4, max_failed_steps=3)
    done = run_in_process([path.name], tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "every judge request failed in 3 steps in a row" in done.stderr
    assert [r["step"] for r in rows(run_dir)] == [1, 2]  # step 3 stopped before it trained
    assert state(run_dir)["status"] == "failed" and state(run_dir)["step"] == 2

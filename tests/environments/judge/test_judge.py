"""Judge rewards: `[reward] type = "judge"` against a real HTTP judge (tests/judge_server.py,
a stand-in for a remote LLM judge): pointwise and group scores, retries and counted zeros on
429 / garbage / no answer, the cache that spares a resumed run, the concurrency cap, a judge
that cannot be reached failing the run at start, and tiny-model runs trained on its scores;
also a real `retrain serve` process (on the tiny model) as the judge of a tiny run."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest

from retrain.config.schema import ConfigError
from retrain.config.sections import RewardConfig, from_dict
from retrain.environments.answers import Problem
from retrain.environments.judge.prompt import parse_group, parse_score
from retrain.environments.judge.reward import CACHE_FILE, JudgeScorer
from retrain.errors import UserError
from tests import warm
from tests.conftest import SERVE_KEY
from tests.judge_server import RUBRIC, JudgeServer, group_scores, pointwise_score
from tests.run_helpers import rows, run_in_process, state, wait_for, write_config

KEY = "sk-judge-test-4f9a"


@pytest.fixture
def server():
    s = JudgeServer()
    yield s
    s.close()


def reward(server: JudgeServer, **judge) -> RewardConfig:
    table = {"base_url": server.base_url, "model": "judge", "rubric": RUBRIC, "retries": 1,
             "timeout_s": 10.0, **judge}
    return from_dict({"reward": {"type": "judge", "judge": table}}).reward


def group_of(prompt: str, texts: list[str]) -> tuple[list[str], list[Problem]]:
    p = Problem(prompt=prompt, answer="7")
    return texts, [p] * len(texts)


# ---------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(("reply", "score"), [
    ("Good.\nSCORE: 0.75", 0.75), ("score = 1", 1.0), ("**Score:** 0.5", 0.5),
    ("0.25", 0.25), ("SCORE: 0.2 ... no wait, SCORE: 0.4", 0.4),
    ("SCORE: 7", None), ("lovely", None), ("", None), ("SCORE: -0.1", None),
])
def test_parse_score(reply, score):
    assert parse_score(reply) == score


def test_parse_group_needs_every_reply():
    assert parse_group("SCORE 1: 0.5\nSCORE 2: 1\nSCORE [3]: 0", 3) == [0.5, 1.0, 0.0]
    assert parse_group("SCORE 1: 0.5\nSCORE 3: 1", 3) is None
    assert parse_group("SCORE 1: 0.5\nSCORE 2: 3", 2) is None


def test_judge_table_is_checked():
    with pytest.raises(ConfigError) as err:
        from_dict({"reward": {"type": "judge", "judge": {"model": "m", "mode": "pairs",
                                                         "retry": 2}}})
    text = str(err.value)
    assert "reward.judge.mode" in text and "reward.judge.retry: unknown key" in text
    assert "reward.judge.base_url" in text
    with pytest.raises(ConfigError, match="reward.judge: is for reward.type = 'judge'"):
        from_dict({"reward": {"type": "match", "judge": {"model": "m"}}})


# ---------------------------------------------------------------------------- the scorer


def test_pointwise_scores_cache_and_key(server, tmp_path, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", KEY)
    texts, problems = group_of("What is 3 + 4?", ["7", "it is 7", "eight", "\\boxed{7}"])
    scorer = JudgeScorer(reward(server, api_key_env="JUDGE_KEY"), tmp_path, tmp_path)
    scores = scorer.score(texts, problems)
    scorer.close()
    assert scores.rewards == [pointwise_score(t) for t in texts]
    assert scores.correct == [False, False, False, True]
    assert scores.metrics["judge_calls"] == 4 == server.requests
    assert scores.metrics["judge_cache_hits"] == 0 and scores.failures == 0
    assert server.auth == {f"Bearer {KEY}"}
    assert "What is 3 + 4?" in server.prompts[0] and "Reference: 7" in server.prompts[0]
    # a new scorer on the same run folder (a resume) pays for nothing it already has
    again = JudgeScorer(reward(server, api_key_env="JUDGE_KEY"), tmp_path, tmp_path)
    cached = again.score(texts + ["new"], problems + problems[:1])
    again.close()
    assert cached.rewards == scores.rewards + [pointwise_score("new")]
    assert cached.metrics["judge_cache_hits"] == 4 and cached.metrics["judge_calls"] == 1
    assert server.requests == 5
    assert KEY not in (tmp_path / CACHE_FILE).read_text()


def test_group_mode_sends_one_request_per_prompt(server, tmp_path):
    a_texts, a = group_of("What is 3 + 4?", ["7", "seven", "8"])
    b_texts, b = group_of("What is 1 + 1?", ["2", "11", "two"])
    scorer = JudgeScorer(reward(server, mode="group"), tmp_path, None)
    scores = scorer.score(a_texts + b_texts, a + b)
    scorer.close()
    assert server.requests == 2 == scores.metrics["judge_calls"]
    blocks = [p.split("<<", 1)[1].rsplit(">>", 1)[0] for p in server.prompts]
    assert all("[1]\n" in blk and "[3]\n" in blk for blk in blocks)
    expected = {tuple(group_scores(blk, 3)) for blk in blocks}
    assert {tuple(scores.rewards[:3]), tuple(scores.rewards[3:])} == expected


@pytest.mark.parametrize(("mode", "counted"), [("429", "judge_errors"), ("hang", "judge_errors"),
                                               ("garbage", "judge_parse_errors"),
                                               ("junk", None)])
def test_failing_judge_gives_counted_zeros(server, tmp_path, mode, counted):
    server.mode = mode
    texts, problems = group_of("What is 3 + 4?", ["7", "seven"])
    scorer = JudgeScorer(reward(server, timeout_s=1.0), tmp_path, tmp_path)
    scores = scorer.score(texts, problems)
    scorer.close()
    assert scores.rewards == [0.0, 0.0] and scores.failures == 2
    m = scores.metrics
    if counted:
        assert m[counted] == 2
    else:  # a body the SDK cannot read: an error or an unreadable reply, never a score
        assert m["judge_errors"] + m["judge_parse_errors"] == 2
    retried = mode in ("429", "hang")
    assert m["judge_calls"] == (4 if retried else 2) == server.requests
    assert not (tmp_path / CACHE_FILE).exists() or not (tmp_path / CACHE_FILE).read_text()


def test_max_concurrent_caps_requests_in_flight(server, tmp_path):
    server.delay_s = 0.2
    texts, problems = group_of("What is 3 + 4?", [str(i) for i in range(8)])
    scorer = JudgeScorer(reward(server, max_concurrent=2), tmp_path, None)
    scorer.score(texts, problems)
    scorer.close()
    assert server.requests == 8 and server.max_in_flight == 2


def test_unreachable_judge_fails_at_start_naming_the_url(tmp_path, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    cfg = from_dict({"reward": {"type": "judge",
                                "judge": {"base_url": url, "model": "m"}}}).reward
    with pytest.raises(UserError, match=f"reward.judge.base_url = {url}: the judge cannot be "
                                        "reached"):
        JudgeScorer(cfg, tmp_path, tmp_path)
    monkeypatch.delenv("NO_SUCH_JUDGE_KEY", raising=False)
    keyed = from_dict({"reward": {"type": "judge", "judge": {
        "base_url": url, "model": "m", "api_key_env": "NO_SUCH_JUDGE_KEY"}}}).reward
    with pytest.raises(UserError, match="NO_SUCH_JUDGE_KEY'?: the variable is not set"):
        JudgeScorer(keyed, tmp_path, tmp_path)


# ---------------------------------------------------------------------------- tiny runs


def judge_run(tmp_path, server, name: str, **judge):
    table = {"base_url": server.base_url, "model": "judge", "rubric": RUBRIC, "retries": 1,
             "timeout_s": 10.0, **judge}
    return write_config(tmp_path, name, reward={"type": "judge", "judge": table},
                        data={"source": "arithmetic", "eval_size": 0},
                        training={"max_steps": 3, "save_every": 1})


def launch(cwd, path, env=None):
    """`retrain PATH` from `cwd`, in this process: what is tested is the judge, not the
    process boundary (the SIGKILL test below starts its first run as a process)."""
    return run_in_process([path.name], cwd, env)


@pytest.mark.parametrize("mode", ["pointwise", "group"])
def test_judge_rewarded_tiny_run_trains_three_steps(tmp_path, tiny_model, server, mode):
    path = judge_run(tmp_path, server, "judged", mode=mode)
    done = launch(tmp_path, path)
    assert done.returncode == 0, done.stdout + done.stderr
    got = rows(tmp_path / "logs" / "judged")
    assert [r["step"] for r in got] == [1, 2, 3]
    per_step = 2 if mode == "group" else 8  # batch 2 x group 4
    assert all(r["judge_calls"] == per_step and r["judge_errors"] == 0
               and r["judge_parse_errors"] == 0 and r["judge_seconds"] > 0 for r in got)
    assert server.requests == 3 * per_step
    assert any(r["reward_std"] > 0 for r in got) and any(r["grad_norm"] > 0 for r in got)


def served_judge_run(tmp_path, served, mode: str = "pointwise", model: str = "tiny-random"):
    """A 3-step tiny run judged by `retrain serve` on the tiny model (key: $SERVE_JUDGE_KEY)."""
    table = {"base_url": f"{served.url}/v1", "model": model, "mode": mode,
             "api_key_env": "SERVE_JUDGE_KEY", "max_tokens": 8, "retries": 0,
             "timeout_s": 60.0}
    return write_config(tmp_path, "served", reward={"type": "judge", "judge": table},
                        data={"source": "arithmetic", "eval_size": 0},
                        training={"max_steps": 3, "save_every": 1})


@pytest.mark.parametrize("mode", ["pointwise", "group"])
def test_retrain_serve_as_the_judge_of_a_tiny_run(tmp_path, tiny_serve, mode):
    """The random tiny model's greedy replies are bytes with no score in them: each is
    counted (judge_parse_errors) and scores 0. What must hold: serve answered every request
    (no judge_errors: a refused key, a 4xx or a dropped connection would count there), the
    rows carry the judge's metrics, and only readable answers reached the cache."""
    path = served_judge_run(tmp_path, tiny_serve, mode)
    done = launch(tmp_path, path, {"SERVE_JUDGE_KEY": SERVE_KEY})
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = tmp_path / "logs" / "served"
    got = rows(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3]
    per_step = 2 if mode == "group" else 8  # batch 2 x group 4
    for r in got:
        assert r["judge_calls"] == per_step and r["judge_errors"] == 0, r
        assert 0 <= r["judge_parse_errors"] <= per_step and r["judge_cache_hits"] == 0, r
        assert r["judge_seconds"] > 0 and r["num_completions"] == 8, r
    readable = sum(r["judge_calls"] - r["judge_parse_errors"] for r in got)
    cache = run_dir / CACHE_FILE
    assert (len(cache.read_text().splitlines()) if cache.exists() else 0) == readable
    assert "Traceback" not in tiny_serve.log()


def test_retrain_serve_refusing_the_key_stops_the_run_at_start(tmp_path, tiny_serve):
    path = served_judge_run(tmp_path, tiny_serve)
    done = launch(tmp_path, path, {"SERVE_JUDGE_KEY": "sk-wrong"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"reward.judge.base_url = {tiny_serve.url}/v1: the judge refused the API key " \
        "(from $SERVE_JUDGE_KEY)" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr and "sk-wrong" not in done.stderr + done.stdout


def test_a_misspelled_model_on_retrain_serve_stops_the_run_at_start(tmp_path, tiny_serve):
    path = served_judge_run(tmp_path, tiny_serve, model="tiny-randon")
    done = launch(tmp_path, path, {"SERVE_JUDGE_KEY": SERVE_KEY})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "reward.judge.model = 'tiny-randon': the judge at " in done.stderr
    assert "it lists 'tiny-random'" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "logs" / "served" / "metrics.jsonl").exists()


def test_judge_answering_429_gives_zeros_and_a_finished_run(tmp_path, tiny_model, server):
    """An outage shorter than max_failed_steps (a longer one:
    tests/environments/judge/test_judge_probe.py)."""
    server.mode = "429"
    path = judge_run(tmp_path, server, "limited", retries=0, max_failed_steps=4)
    done = launch(tmp_path, path)
    assert done.returncode == 0, done.stdout + done.stderr
    got = rows(tmp_path / "logs" / "limited")
    assert [r["step"] for r in got] == [1, 2, 3]
    assert all(r["judge_errors"] == 8 and r["mean_reward"] == 0 and r["reward_failures"] == 8
               for r in got)
    assert "HTTP 429" in done.stdout + done.stderr


def test_unreachable_judge_stops_the_run_at_start(tmp_path, server):
    path = judge_run(tmp_path, server, "nojudge")
    server.close()
    done = launch(tmp_path, path)
    assert done.returncode == 2
    assert f"reward.judge.base_url = {server.base_url}: the judge cannot be reached" in \
        done.stderr + done.stdout
    assert "Traceback" not in done.stderr


def test_resume_after_sigkill_does_not_ask_the_judge_again(tmp_path, cli_env, python,
                                                           tiny_model, server):
    path = judge_run(tmp_path, server, "resumed", max_concurrent=1)
    run_dir = tmp_path / "logs" / "resumed"
    server.block_after = 8 + 3  # step 1, then 3 answers of step 2; the 4th hangs
    proc = warm.Popen([python, "-m", "retrain", path.name], cwd=tmp_path, env=cli_env,
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        cache = run_dir / "judge_cache.jsonl"  # step 1's 8 answers and step 2's first 3
        wait_for(lambda: server.requests > server.block_after
                 and (run_dir / "state.json").exists() and state(run_dir)["step"] == 1
                 and cache.exists() and len(cache.read_text().splitlines()) == 8 + 3,
                 proc, timeout=240)
    finally:
        proc.kill()
        proc.wait()
    server.block_after = None
    before = server.requests
    done = launch(tmp_path, path)
    assert done.returncode == 0, done.stdout + done.stderr
    step2 = [r for r in rows(run_dir) if r["step"] == 2][-1]
    assert step2["judge_cache_hits"] == 3 and step2["judge_calls"] == 5
    assert server.requests - before == 5 + 8  # the rest of step 2, then step 3


def test_campaign_runs_share_the_judge_budget(tmp_path, cli_env, python, tiny_model, server):
    """3 runs at once, judge.max_concurrent = 2: never more than 2 requests at the judge."""
    from bench.campaign.tiny import tiny_campaign_toml

    server.delay_s = 1.0  # the runs' judging overlaps: 12 requests take >= 6 s at 2 at once
    judge = (f'[reward]\ntype = "judge"\n[reward.judge]\nbase_url = "{server.base_url}"\n'
             f'model = "judge"\nrubric = {json.dumps(RUBRIC)}\nmax_concurrent = 2\n')
    path = tmp_path / "camp.toml"
    path.write_text(tiny_campaign_toml(tmp_path / "logs", [1, 2, 3], max_steps=1,
                                       max_workers=3, tables=judge))
    done = warm.run([python, "-m", "retrain", "run", str(path)], cwd=tmp_path,
                    env=cli_env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    assert server.requests == 3 * 4  # 3 runs x batch 2 x group 2
    assert server.max_in_flight == 2


@pytest.mark.parametrize(("mode", "per_step"), [("pointwise", "32 requests, 96 at worst"),
                                                ("group", "4 requests, 12 at worst")])
def test_explain_shows_the_judge_and_its_worst_case(tmp_path, monkeypatch, mode, per_step):
    from retrain.cli.explain import dry_run as explain

    monkeypatch.chdir(tmp_path)
    path = tmp_path / "j.toml"
    path.write_text('[training]\nbatch_size = 4\ngroup_size = 8\n[reward]\ntype = "judge"\n'
                    '[reward.judge]\nbase_url = "http://judge:8000/v1"\nmodel = "qwen"\n'
                    f'mode = "{mode}"\nretries = 2\nmax_concurrent = 3\n')
    lines = "\n".join(explain.plain_lines(explain.build_report(path)))
    assert f"qwen at http://judge:8000/v1, {mode}; at most 3 requests in flight (per run)" \
        in lines
    assert f"per step {per_step} with retries" in lines


@pytest.mark.parametrize(("url", "shown"), [
    ("localhost:8000/v1", "'localhost:8000/v1' has no scheme; write 'http://localhost:8000/v1'"),
    ("ftp://judge/v1", "over http:// or https://; write 'http://judge/v1'"),
    ("http://", "'http://' names no host"),
])
def test_explain_refuses_a_judge_url_without_its_scheme(tmp_path, url, shown):
    """Without http://, the run could only say "cannot be reached": explain (and the run)
    refuse it when the file loads, in one line naming the key and the fix."""
    path = tmp_path / "j.toml"
    path.write_text(f'[reward]\ntype = "judge"\n[reward.judge]\nbase_url = "{url}"\n'
                    'model = "qwen"\n')
    done = run_in_process(["explain", path.name], tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "j.toml: reward.judge.base_url: " in errors[0] and shown in errors[0]

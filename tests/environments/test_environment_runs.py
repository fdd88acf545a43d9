"""Multi-turn environments train end to end on the tiny model: metrics, faults, resume."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from retrain.config import toml_io  # noqa: E402
from retrain.config.loader import load_config  # noqa: E402
from retrain.run.single import run_single  # noqa: E402
from tests import warm  # noqa: E402
from tests.run_helpers import BASE, rows, run_in_process, state  # noqa: E402

ENVS = Path(__file__).parents[1] / "data" / "envs"
ENV_METRICS = ("mean_turns", "max_turns_hit", "episode_tokens", "env_seconds", "env_errors",
               "truncated", "bridges", "tool_calls")


@pytest.fixture
def workdir(tmp_path, monkeypatch, tiny_model):
    monkeypatch.chdir(tmp_path)
    shutil.copy(ENVS / "counter_env.py", tmp_path / "counter_env.py")
    return tmp_path


def write_config(folder: Path, name: str = "run", environment=None, data=None,
                 training=None) -> Path:
    """The tiny-model config of tests/run_helpers.py, with [environment] instead of [reward]."""
    raw = {k: dict(v) for k, v in BASE.items() if k != "reward"}
    raw["data"] = data or {"eval_size": 2}
    raw["training"].update(training or {})
    raw["environment"] = environment or {}
    path = folder / f"{name}.toml"
    path.write_text(toml_io.dumps(raw))
    return path


def env_config(folder: Path, factory: str, name: str = "run", training=None, **env) -> Path:
    env = {"kind": "python", "factory": f"counter_env.py:{factory}", "on_length": "continue",
           **env}
    return write_config(folder, name=name, environment=env,
                        training={"max_steps": 2, "batch_size": 1, "group_size": 4,
                                  **(training or {})})


def run(path: Path) -> int:
    return run_single(load_config(path, {}), path)


def test_a_multi_turn_environment_trains_with_its_metrics(workdir):
    path = env_config(workdir, "Digits", params={"turns": 3})
    assert run(path) == 0
    got = rows(workdir / "logs" / "run")
    assert [r["step"] for r in got] == [1, 2]
    for r in got:
        assert set(ENV_METRICS) <= set(r), set(ENV_METRICS) - set(r)
        assert r["mean_turns"] == 3 and r["max_turns_hit"] == 0 and r["env_errors"] == 0
        assert r["num_completions"] == 4
        assert r["episode_tokens"] > 3 * 8 and "env_digit_share" in r
        assert r["max_token_hit_rate"] >= 0.5  # the random model seldom stops by itself
    # a group whose four episodes all score 0 trains nothing; which step that is depends on
    # the sampler's draws
    assert any(r["trained_completions"] > 0 for r in got), got
    # Multi-turn sequences, scored by the trainer on the same weights: the sampler's log-probs.
    trained = next(r for r in got if r["trained_completions"] > 0)
    assert trained["sampler_trainer_logprob_diff"] < 1e-4
    assert "initial_eval_accuracy" in got[0]
    assert "eval_accuracy" in got[-1] and "eval_mean_reward" in got[-1]


def test_guess_number_runs_and_ends_at_max_turns(workdir):
    path = write_config(workdir, environment={"kind": "guess_number", "max_turns": 2,
                                              "on_length": "continue"},
                        data={"eval_size": 0}, training={"max_steps": 1, "batch_size": 2,
                                                         "group_size": 2})
    assert run(path) == 0
    (r,) = rows(workdir / "logs" / "run")
    assert 1 <= r["mean_turns"] <= 2 and r["env_errors"] == 0


def test_an_environment_that_never_says_done_hits_max_turns(workdir):
    path = env_config(workdir, "NeverDone", max_turns=2, training={"max_steps": 1})
    assert run(path) == 0
    (r,) = rows(workdir / "logs" / "run")
    assert r["max_turns_hit"] == 1.0 and r["mean_turns"] == 2
    assert r["mean_reward"] == pytest.approx(0.2)


def test_a_cut_reply_ends_the_episode_by_default(workdir):
    path = env_config(workdir, "NeverDone", max_turns=3, on_length="end",
                      training={"max_steps": 1})
    assert run(path) == 0
    (r,) = rows(workdir / "logs" / "run")
    assert r["mean_turns"] == 1 and r["truncated"] == 1.0


def test_an_environment_that_raises_is_counted_and_the_run_completes(workdir, capsys):
    path = env_config(workdir, "Raises", max_turns=3, training={"max_steps": 1})
    assert run(path) == 0
    (r,) = rows(workdir / "logs" / "run")
    assert r["env_errors"] == 4 and r["mean_reward"] == 0.0  # zero_reward
    assert "the environment broke" in capsys.readouterr().out


def test_drop_group_leaves_a_failed_group_out_of_training(workdir):
    path = env_config(workdir, "Raises", max_turns=3, on_env_error="drop_group",
                      training={"max_steps": 1})
    assert run(path) == 0
    (r,) = rows(workdir / "logs" / "run")
    assert r["env_errors"] == 4 and r["trained_completions"] == 0


def test_a_hung_step_is_killed_and_counted(workdir):
    # group_size 2: one group per step; its seed decides whether both of its episodes hang.
    path = env_config(workdir, "Hangs", max_turns=2, step_timeout_s=0.5,
                      training={"max_steps": 3, "group_size": 2})
    assert run(path) == 0
    got = rows(workdir / "logs" / "run")
    errors = [r["env_errors"] for r in got]
    assert all(e in (0, 2) for e in errors) and any(errors), errors


def test_repeated_worker_deaths_fail_the_run_with_a_clear_error(workdir, capsys):
    path = env_config(workdir, "Hangs", max_turns=2, step_timeout_s=0.3,
                      params={"always": True}, training={"max_steps": 1})
    assert run(path) == 1
    err = capsys.readouterr().err
    assert "environment worker process died or hung 4 times in one step" in err
    assert state(workdir / "logs" / "run")["status"] == "failed"


def test_data_and_reward_keys_conflict_with_another_kind(workdir):
    from retrain.config.schema import ConfigError

    path = write_config(workdir, environment={"kind": "guess_number"},
                        data={"source": "countdown"})
    with pytest.raises(ConfigError, match="data.source: is for environment.kind = 'task'"):
        load_config(path, {})
    raw = toml_io.loads(path.read_text())
    raw["data"] = {}
    raw["reward"] = {"type": "math"}
    path.write_text(toml_io.dumps(raw))
    with pytest.raises(ConfigError, match="remove \\[reward\\]"):
        load_config(path, {})


def test_a_broken_factory_is_one_error_line(workdir):
    from retrain.errors import UserError

    path = env_config(workdir, "Missing")
    with pytest.raises(UserError, match="has no function 'Missing'"):
        run(path)


def test_resume_after_sigkill_reproduces_the_next_steps_episodes(workdir, cli_env):
    keys = ("mean_reward", "episode_tokens", "mean_turns", "loss", "mean_completion_tokens")
    ref = env_config(workdir, "Digits", name="ref", training={"max_steps": 3},
                     params={"turns": 2}, max_turns=2)
    cmd = [sys.executable, "-m", "retrain"]
    assert run_in_process([ref], workdir).returncode == 0
    killed = env_config(workdir, "Digits", name="killed", training={"max_steps": 3},
                        params={"turns": 2, "kill_parent_on_step": 16}, max_turns=2)
    first = warm.run([*cmd, str(killed)], env=cli_env, capture_output=True, text=True)
    assert first.returncode == -9, first.stderr[-2000:]
    assert len(rows(workdir / "logs" / "killed")) == 1  # 4 eval + 8 step-1 calls, then step 2
    again = run_in_process([killed], workdir)  # the resume: in this process
    assert again.returncode == 0, again.stderr[-2000:]
    want = [{k: r[k] for k in keys} for r in rows(workdir / "logs" / "ref")]
    assert [{k: r[k] for k in keys} for r in rows(workdir / "logs" / "killed")] == want


def test_eval_samples_score_k_episodes_per_held_out_seed(workdir):
    """eval_samples = k: k sampled episodes per held-out seed beside the greedy one; their
    mean@k, pass@k and its standard error on the eval rows, the same twice for one seed."""
    path = write_config(workdir, environment={"kind": "python",
                                              "factory": "counter_env.py:EvenLength"},
                        data={"eval_size": 6},
                        training={"max_steps": 2, "batch_size": 1, "group_size": 4,
                                  "eval_samples": 8, "eval_temperature": 1.0})
    assert run(path) == 0
    got = rows(workdir / "logs" / "run")
    first, last = got[0], got[-1]
    assert 0 < first["initial_eval_mean_at_k"] < first["initial_eval_pass_at_k"] <= 1
    assert first["initial_eval_mean_at_k_se"] > 0
    assert 0 <= last["eval_mean_at_k"] <= last["eval_pass_at_k"] <= 1
    assert run_single(load_config(path, {}), path, new=True) == 0
    again = rows(workdir / "logs" / "run")
    keys = [k for k in first if "_at_k" in k]
    assert [r.get(k) for r in again for k in keys] == [r.get(k) for r in got for k in keys]


def test_retrain_eval_samples_report_the_rows_figures_seeded(workdir):
    """`retrain eval --samples k` on episodes: eval_mean_at_k, eval_pass_at_k and the error as
    its evals file's lines give them by hand, and the same draws twice."""
    from retrain.cli.app import run_app
    from retrain.results.evaluate import EvalRequest, evaluate

    path = write_config(workdir, environment={"kind": "python",
                                              "factory": "counter_env.py:EvenLength"},
                        data={"eval_size": 5}, training={"max_steps": 1, "batch_size": 1,
                                                         "group_size": 4})
    assert run_app(["run", str(path)]) == 0  # as a user runs it: file references anchored
    run_dir = workdir / "logs" / "run"
    report = evaluate(run_dir, EvalRequest(samples=6, temperature=1.0))
    lines = [json.loads(x) for x in Path(report.file).read_text().splitlines()]
    per_seed = [[r["correct"] for r in lines[i * 6:(i + 1) * 6]] for i in range(5)]
    rates = [sum(s) / 6 for s in per_seed]
    assert report.eval_mean_at_k == pytest.approx(sum(rates) / 5)
    assert report.eval_pass_at_k == sum(any(s) for s in per_seed) / 5
    m = sum(rates) / 5
    se = (sum((r - m) ** 2 for r in rates) / 4 / 5) ** 0.5
    assert report.eval_mean_at_k_se == pytest.approx(se)
    assert 0 < report.eval_mean_at_k < report.eval_pass_at_k  # the figures can tell runs apart
    again = evaluate(run_dir, EvalRequest(samples=6, temperature=1.0))
    assert Path(again.file).read_text() == Path(report.file).read_text()

"""The step loop on the tiny model, in process: metrics rows, checkpoints, resume rules, errors."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import subprocess  # noqa: E402

from retrain.backends.base import BackendOOMError  # noqa: E402
from retrain.config.loader import load_config  # noqa: E402
from retrain.errors import UserError  # noqa: E402
from retrain.run.seeds import derive_seed  # noqa: E402
from retrain.run.single import run_single  # noqa: E402
from retrain.runfiles import runlog  # noqa: E402
from tests.run_helpers import rows, state, write_config  # noqa: E402

PROMISED = ("step", "batch_size", "group_size", "num_completions", "mean_reward", "reward_std",
            "correct_rate", "max_token_hit_rate", "mean_completion_tokens", "loss", "grad_norm",
            "lr", "step_time_s", "sample_time_s", "reward_time_s", "train_time_s",
            "tokens_per_second", "reward_uniform_group_rate", "sampler_trainer_logprob_diff",
            "process_max_rss_mb", "api_wait_s", "reward_failures", "oom_retries", "time")


@pytest.fixture
def workdir(tmp_path, monkeypatch, tiny_model):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run(path, new=False, **overrides):
    return run_single(load_config(path, overrides), path, new=new)


def test_a_run_writes_every_promised_metric_and_its_files(workdir, capsys):
    path = write_config(workdir, training={"max_steps": 5, "eval_every": 2})
    assert run(path) == 0
    run_dir = workdir / "logs" / "run"
    got = rows(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    for r in got:
        assert set(PROMISED) <= set(r), set(PROMISED) - set(r)
        assert r["num_completions"] == r["batch_size"] * r["group_size"] == 8
        assert r["tokens_per_second"] > 0 and r["step_time_s"] >= r["sample_time_s"]
        assert r["oom_retries"] == 0 and r["reward_failures"] == 0
        assert not any(k.startswith("bp_") for k in r)  # back-pressure is off
    assert [r["step"] for r in got if "eval_accuracy" in r] == [2, 4, 5]
    assert "initial_eval_accuracy" in got[0] and "initial_eval_accuracy" not in got[1]
    assert got[0]["sampler_trainer_logprob_diff"] < 1e-4  # fp32, nothing changed yet
    st = state(run_dir)
    assert st["status"] == "completed" and st["step"] == 5 and st["max_steps"] == 5
    assert st["data_cursor"]["position"] + st["data_cursor"]["epoch"] * \
        st["data_cursor"]["n_items"] == 10
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    kept = ["step-000002", "step-000004", "step-000005"]
    assert names == sorted(kept + [f"{k}.json" for k in kept])  # each with its resume point
    assert (run_dir / "checkpoints" / "step-000005" / "adapter_config.json").exists()
    saved = load_config(run_dir / "config.toml")
    assert saved.logging.run_name == "run" and saved.training.max_steps == 5
    out = capsys.readouterr().out
    assert "eval accuracy before training" in out and "step 5/5" in out
    assert "model: " in out and "on cpu, float32 (as configured)" in out


def test_a_finished_run_is_not_rerun_but_can_be_extended(workdir, capsys):
    path = write_config(workdir, training={"max_steps": 2}, data={"eval_size": 0})
    assert run(path) == 0
    before = rows(workdir / "logs" / "run")
    assert run(path) == 0
    assert "already finished 2 steps" in capsys.readouterr().out
    assert rows(workdir / "logs" / "run") == before
    assert run(path, **{"training.max_steps": 3}) == 0
    after = rows(workdir / "logs" / "run")
    assert after[:2] == before and [r["step"] for r in after] == [1, 2, 3]


def test_resuming_with_a_changed_config_is_refused(workdir):
    path = write_config(workdir, training={"max_steps": 2}, data={"eval_size": 0})
    assert run(path) == 0
    with pytest.raises(UserError, match="training.lr"):
        run(path, **{"training.lr": 0.5, "training.max_steps": 3})


def test_new_moves_the_old_run_aside(workdir, capsys):
    path = write_config(workdir, training={"max_steps": 2}, data={"eval_size": 0})
    assert run(path) == 0
    assert run(path, new=True) == 0
    moved = [p for p in (workdir / "logs").iterdir() if p.name.startswith("run.prev-")]
    assert len(moved) == 1 and len(rows(moved[0])) == 2
    assert len(rows(workdir / "logs" / "run")) == 2
    assert "moved the previous run" in capsys.readouterr().out


def test_a_failing_reward_function_is_counted_not_fatal(workdir, capsys):
    path = write_config(workdir, reward={"function": "digits.py:flaky"},
                        training={"max_steps": 3, "max_tokens": 16}, data={"eval_size": 0})
    assert run(path) == 0
    got = rows(workdir / "logs" / "run")
    assert len(got) == 3 and sum(r["reward_failures"] for r in got) > 0
    assert "this scorer breaks on ones" in capsys.readouterr().out


def test_uniform_groups_still_write_a_row(workdir):
    path = write_config(workdir, reward={"function": "digits.py:constant"},
                        training={"max_steps": 2}, data={"eval_size": 0})
    assert run(path) == 0
    for r in rows(workdir / "logs" / "run"):
        assert r["reward_uniform_group_rate"] == 1.0 and r["mean_reward"] == 1.0
        assert r["loss"] == 0.0 and r["grad_norm"] == 0.0 and r["trained_completions"] == 0
        assert r["sampler_trainer_logprob_diff"] is None


def test_missing_custom_module_and_broken_jsonl_are_user_errors(workdir):
    path = write_config(workdir, reward={"function": "nowhere:reward"})
    with pytest.raises(UserError, match="reward.function"):
        run(path)
    (workdir / "data.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": oops}\n')
    path = write_config(workdir, data={"source": "jsonl", "path": "data.jsonl", "eval_size": 0})
    with pytest.raises(UserError, match=r"data.jsonl:2"):
        run(path)
    assert not (workdir / "logs" / "run" / "metrics.jsonl").exists()


def test_out_of_memory_halves_the_batch_and_keeps_groups_whole(workdir, monkeypatch):
    from retrain.backends.local.backend import LocalBackend

    real = LocalBackend.sample
    calls = []

    def sample(self, prompts, n, params, adapter=None):
        calls.append(len(prompts))
        if len(prompts) > 2:
            raise BackendOOMError("out of memory during sampling (simulated)")
        return real(self, prompts, n, params, adapter)

    monkeypatch.setattr(LocalBackend, "sample", sample)
    path = write_config(workdir, training={"max_steps": 3, "batch_size": 4},
                        data={"eval_size": 0})
    assert run(path) == 0
    got = rows(workdir / "logs" / "run")
    assert [r["batch_size"] for r in got] == [2, 2, 2]
    assert [r["oom_retries"] for r in got] == [1, 0, 0]
    assert all(r["num_completions"] == 8 for r in got)
    assert calls == [4, 2, 2, 2]
    cursor = state(workdir / "logs" / "run")["data_cursor"]
    assert cursor["position"] == 6  # the failed attempt consumed no data


def test_a_resume_point_with_the_old_oom_cap_keeps_its_ceiling(workdir):
    path = write_config(workdir, training={"max_steps": 3, "batch_size": 4},
                        data={"eval_size": 0})
    assert run(path, **{"training.max_steps": 2}) == 0
    run_dir = workdir / "logs" / "run"
    st = runlog.load_state(run_dir)     # as written before the controller owned the ceiling
    st.extra["oom_cap"], st.batch_size, st.controller = 2, 99, {}
    st.status, st.pid = "running", _dead_pid()
    runlog.save_state(run_dir, st)
    assert run(path) == 0
    assert rows(run_dir)[2]["batch_size"] == 4   # 99 is out of range: the configured size ...
    after = state(run_dir)
    assert after["batch_size"] == 2              # ... and then the old cap
    assert after["controller"] == {"ceiling": 3} and "oom_cap" not in after["extra"]


def test_an_out_of_memory_retry_takes_the_controllers_size(workdir, monkeypatch):
    from retrain.backends.local.backend import LocalBackend
    from retrain.control.backpressure import controller as backpressure
    from retrain.control.backpressure.decision import Decision

    real, calls = LocalBackend.sample, []

    def sample(self, prompts, n, params, adapter=None):
        calls.append(len(prompts))
        if len(prompts) > 3:
            raise BackendOOMError("out of memory during sampling (simulated)")
        return real(self, prompts, n, params, adapter)

    def observe(self, batch_size, tokens, step_time_s, **kw):   # 3 worked before, say
        return Decision("throttle" if kw.get("oom") else "hold", "optimal",
                        3 if kw.get("oom") else batch_size)

    monkeypatch.setattr(LocalBackend, "sample", sample)
    monkeypatch.setattr(backpressure.BackpressureController, "observe", observe)
    bp = {"enabled": True, "warmup_steps": 0, "min_batch_size": 4, "max_batch_size": 4}
    path = write_config(workdir, backpressure=bp, data={"eval_size": 0},
                        training={"max_steps": 1, "batch_size": 4})
    assert run(path) == 0
    assert calls == [4, 3]                  # not 4 // 2
    assert rows(workdir / "logs" / "run")[0]["batch_size"] == 3


def test_the_controller_is_not_charged_for_failed_attempts(workdir, monkeypatch):
    import time

    from retrain.backends.local.backend import LocalBackend
    from retrain.control.backpressure import controller as backpressure

    real, seen = LocalBackend.sample, []
    real_observe = backpressure.BackpressureController.observe

    def sample(self, prompts, n, params, adapter=None):
        if len(prompts) > 1:
            time.sleep(0.5)                    # a slow attempt that then runs out of memory
            raise BackendOOMError("out of memory during sampling (simulated)")
        return real(self, prompts, n, params, adapter)

    def observe(self, batch_size, tokens, step_time_s, **kw):
        if not kw.get("oom"):
            seen.append(step_time_s)
        return real_observe(self, batch_size, tokens, step_time_s, **kw)

    monkeypatch.setattr(LocalBackend, "sample", sample)
    monkeypatch.setattr(backpressure.BackpressureController, "observe", observe)
    path = write_config(workdir, training={"max_steps": 1, "batch_size": 2},
                        data={"eval_size": 0})
    assert run(path) == 0
    (row,) = rows(workdir / "logs" / "run")
    assert row["oom_retries"] == 1 and row["step_time_s"] >= 0.5   # the step's wall time ...
    assert seen == [pytest.approx(row["step_time_s"] - 0.5, abs=0.25)]   # ... less the failure


def test_oom_at_batch_size_one_fails_the_run_cleanly(workdir, monkeypatch, capsys):
    from retrain.backends.local.backend import LocalBackend

    def sample(self, prompts, n, params, adapter=None):
        raise BackendOOMError("out of memory during sampling (simulated)")

    monkeypatch.setattr(LocalBackend, "sample", sample)
    path = write_config(workdir, training={"max_steps": 2, "batch_size": 2},
                        data={"eval_size": 0})
    assert run(path) == 1
    st = state(workdir / "logs" / "run")
    assert st["status"] == "failed" and "batch_size 1" in st["error"]
    assert "out of memory even with batch_size 1" in capsys.readouterr().err


def test_derived_seeds_differ_by_step_and_purpose():
    seeds = {derive_seed(1, s, p) for s in range(50) for p in ("sample", "python")}
    assert len(seeds) == 100 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(1, 3, "sample") == derive_seed(1, 3, "sample")


def test_resume_truncates_rows_written_after_the_checkpoint(workdir):
    path = write_config(workdir, training={"max_steps": 3}, data={"eval_size": 0})
    assert run(path, **{"training.max_steps": 2}) == 0
    run_dir = workdir / "logs" / "run"
    with open(run_dir / "metrics.jsonl", "a") as fh:  # a kill between row and checkpoint
        fh.write('{"step": 3, "mean_reward": 123}\n{"step": 4, "tor')
    st = runlog.load_state(run_dir)
    st.status, st.pid = "running", _dead_pid()
    runlog.save_state(run_dir, st)
    assert run(path) == 0
    got = rows(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3] and got[2]["mean_reward"] != 123


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_back_pressure_drives_the_batch_size_and_survives_resume(workdir):
    bp = {"enabled": True, "warmup_steps": 2, "min_batch_size": 1, "max_batch_size": 4}
    path = write_config(workdir, backpressure=bp, data={"eval_size": 0},
                        training={"max_steps": 5})
    assert run(path, **{"training.max_steps": 3}) == 0
    run_dir = workdir / "logs" / "run"
    st = state(run_dir)
    assert st["controller"]["steps"] == 3
    assert run(path) == 0  # extends to 5 steps, continuing the controller
    got = rows(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert got[0]["batch_size"] == 1  # the warm-up starts at min_batch_size
    assert got[3]["batch_size"] == st["batch_size"]  # the decision saved at step 3 was used
    for r in got:
        assert {"bp_action", "bp_regime", "bp_p_star", "bp_throughput", "bp_p"} <= set(r)
        assert r["bp_p"] == r["batch_size"] * r["group_size"]
        assert 1 <= r["batch_size"] <= 4
    assert state(run_dir)["controller"]["steps"] == 5


def test_back_pressure_moves_are_explained_on_the_console(workdir, capsys, monkeypatch):
    from retrain.control.backpressure import controller as backpressure
    from retrain.control.backpressure.decision import Decision

    def observe(self, batch_size, tokens, step_time_s, **kw):
        nxt = 1 if batch_size > 1 else 2
        return Decision("throttle" if nxt < batch_size else "increase",
                        "retrograde", nxt, p=batch_size * 2, reason="made-up why")

    monkeypatch.setattr(backpressure.BackpressureController, "observe", observe)
    bp = {"enabled": True, "warmup_steps": 0, "min_batch_size": 1, "max_batch_size": 4}
    path = write_config(workdir, backpressure=bp, data={"eval_size": 0},
                        training={"max_steps": 3, "group_size": 2})
    assert run(path) == 0
    out = capsys.readouterr().out
    assert "step 1: back-pressure increase (retrograde), batch_size 1 -> 2: made-up why" in out
    assert "step 2: back-pressure throttle (retrograde), batch_size 2 -> 1: made-up why" in out
    assert [r["batch_size"] for r in rows(workdir / "logs" / "run")] == [1, 2, 1]


def test_a_model_that_cannot_be_loaded_is_a_user_error(workdir):
    (workdir / "not-a-model").mkdir()
    path = write_config(workdir, model={"name": "not-a-model"})
    with pytest.raises(UserError, match="model.name = 'not-a-model': cannot load model"):
        run(path)


def test_a_missing_checkpoint_is_a_user_error_that_suggests_new(workdir):
    import shutil

    path = write_config(workdir, training={"max_steps": 2}, data={"eval_size": 0})
    assert run(path, **{"training.max_steps": 1}) == 0
    shutil.rmtree(workdir / "logs" / "run" / "checkpoints")
    with pytest.raises(UserError, match="--new"):
        run(path)


def test_trackers_that_are_not_installed_are_a_user_error(workdir):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    path = write_config(workdir, logging={"wandb_project": "p"}, data={"eval_size": 0})
    with pytest.raises(UserError, match="pip install wandb"):
        run(path)
    assert runlog.load_state(workdir / "logs" / "run") is None  # never marked running


def test_training_stop_strings_end_the_runs_completions(workdir):
    printable = [chr(c) for c in range(32, 127)]  # the tiny model's bytes: most rows stop soon
    tokens, cut = {}, {}
    for name, stop in (("free", []), ("stopped", printable)):
        path = write_config(workdir, name, training={"max_steps": 2, "save_every": 0,
                                                     "max_tokens": 16, "stop": stop})
        assert run(path) == 0
        got = rows(workdir / "logs" / name)
        tokens[name] = sum(r["mean_completion_tokens"] for r in got)
        cut[name] = sum(r["max_token_hit_rate"] for r in got)
    assert tokens["stopped"] < 0.5 * tokens["free"]
    assert cut["stopped"] < cut["free"]


def _eval_figures(got: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if "eval" in k and k != "eval_time_s"} for r in got]


def test_eval_samples_record_mean_and_pass_at_k_seeded_beside_the_greedy_rows(workdir):
    """eval_samples = k adds mean@k, pass@k and its error on the eval rows (initial_ too), the
    same twice for one seed; the greedy figures and the training itself are unchanged."""
    greedy = write_config(workdir, name="greedy", training={"max_steps": 2})
    sampled = write_config(workdir, name="sampled", training={
        "max_steps": 2, "eval_samples": 4, "eval_temperature": 1.0})
    assert run(greedy) == 0 and run(sampled) == 0
    plain, got = rows(workdir / "logs" / "greedy"), rows(workdir / "logs" / "sampled")
    assert not any("_at_k" in k for r in plain for k in r)  # eval_samples = 1: no new keys
    keys = ("eval_mean_at_k", "eval_pass_at_k", "eval_mean_at_k_se")
    for r, prefix in ((got[0], "initial_"), (got[1], "")):
        m, p, se = (r[prefix + k] for k in keys)
        assert 0 <= m <= p <= 1 and se >= 0
        assert r[prefix + "eval_accuracy"] == plain[got.index(r)][prefix + "eval_accuracy"]
    for a, b in zip(plain, got, strict=True):  # the draws of the eval leave training alone
        assert (a["mean_reward"], a["loss"]) == (b["mean_reward"], b["loss"])
    assert run(sampled, new=True) == 0
    assert _eval_figures(rows(workdir / "logs" / "sampled")) == _eval_figures(got)

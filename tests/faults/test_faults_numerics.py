"""Fault injection, numbers (issue 28 item 1, S1, S2): rewards, advantages, losses and weights
that are not finite never reach a checkpoint; a step that cannot be applied says so, several
in a row stop the run with one line, and a poisoned checkpoint is never resumed from.

The real CLI trains the tiny model in process (as in tests/faults/test_faults.py). Where today's
code can no longer produce a non-finite loss by itself, the fault is injected into the real
loss function (as test_faults.py injects ENOSPC into the real metrics writer).
"""

from __future__ import annotations

import json
import math
import shutil

import pytest

torch = pytest.importorskip("torch")

from retrain.backends.local.training import policy_losses  # noqa: E402
from retrain.cli.app import run_app  # noqa: E402
from tests import warm  # noqa: E402
from tests.run_helpers import rows, state, wait_for, write_config  # noqa: E402

STEPS = {"max_steps": 3, "save_every": 2, "batch_size": 2, "group_size": 4, "max_tokens": 6}
BIG_REWARD = ("def reward(completion, answer):\n"
              "    return 1e20 if len(completion) % 2 else -1e20\n")
SPREAD_REWARD = ("def reward(completion, answer):\n"  # groups are (almost) never uniform
                 "    return (sum(map(ord, completion)) % 101) / 101\n")
NONFINITE_REWARD = ("def reward(completion, answer):\n"
                    "    return [float('inf'), float('nan'), 1e39, -1e39][len(completion) % 4]\n")


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = run_app(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def weights(run_dir, step: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoints" / f"step-{step:06d}" /
                         "adapter_model.safetensors"))


def finite(ws: dict) -> bool:
    return all(bool(torch.isfinite(w).all()) for w in ws.values())


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("algorithm", [{"advantage": "dr_grpo"}, {"advantage": "rloo"},
                                       {"advantage": "grpo", "std_scale": "none"}])
def test_rewards_of_1e20_in_reward_units_still_train(tmp_path, monkeypatch, capsys, tiny_model,
                                                     algorithm):
    """S1: the float32 gradient norm overflowed, every update was skipped silently, the run
    said "finished" with the adapter unchanged. Now the advantages are scaled down (by a
    power of two) before the loss, so every step updates, with a finite gradient norm."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "big.py").write_text(BIG_REWARD)
    write_config(tmp_path, training=STEPS, data={"eval_size": 0}, algorithm=algorithm,
                 reward={"function": "big.py:reward"})
    code, out, err = cli(capsys, "run.toml")
    assert code == 0, err
    run = tmp_path / "logs" / "run"
    for row in rows(run):
        assert row["skipped_nonfinite"] is False, row
        assert isinstance(row["grad_norm"], float) and math.isfinite(row["grad_norm"]), row
        assert abs(row["loss"]) < 1e6, row
    assert "divided by" in out
    assert finite(weights(run, 3)) and not same(weights(run, 2), weights(run, 3))


def test_nonfinite_rewards_are_failures_and_huge_ones_train(tmp_path, monkeypatch, capsys,
                                                            tiny_model):
    """inf and nan from a custom reward score 0 and are reported; +-1e39 (beyond float32)
    with rloo trains with finite advantages instead of overflowing the loss."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.py").write_text(NONFINITE_REWARD)
    write_config(tmp_path, training=STEPS, data={"eval_size": 0},
                 algorithm={"advantage": "rloo"}, reward={"function": "bad.py:reward"})
    code, out, err = cli(capsys, "run.toml")
    assert code == 0, err
    assert "not a finite number" in out
    run_rows = rows(tmp_path / "logs" / "run")
    assert sum(r["reward_failures"] for r in run_rows) > 0
    for row in run_rows:
        assert row["skipped_nonfinite"] is False and math.isfinite(row["grad_norm"]), row
        assert math.isfinite(row["mean_reward"]), row
    assert finite(weights(tmp_path / "logs" / "run", 3))


def _poison_loss_from(monkeypatch, calls_before: int) -> None:
    """The real loss, made NaN after `calls_before` forward_backward micro-batches."""
    real, seen = policy_losses.token_losses, {"n": 0}

    def poisoned(*args):
        seen["n"] += 1
        out = real(*args)
        if seen["n"] > calls_before:
            out.loss = out.loss * float("nan")
        return out
    monkeypatch.setattr(policy_losses, "token_losses", poisoned)


def test_nonfinite_steps_are_skipped_shown_and_stop_the_run(tmp_path, monkeypatch, capsys,
                                                            tiny_model):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "spread.py").write_text(SPREAD_REWARD)
    write_config(tmp_path, training={**STEPS, "max_steps": 8, "micro_batch_size": 64},
                 data={"eval_size": 0}, reward={"function": "spread.py:reward"})
    _poison_loss_from(monkeypatch, calls_before=1)  # step 1 is sound, then every loss is NaN
    code, out, err = cli(capsys, "run.toml")
    assert code == 1
    line = one_error_line(err)
    assert "3 steps in a row (steps 2-4)" in line and "max_nonfinite_steps" in line, line
    run = tmp_path / "logs" / "run"
    got = rows(run)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [r["skipped_nonfinite"] for r in got] == [False, True, True, True]
    assert out.count("skipped_nonfinite") == 3  # on the progress line of each skipped step
    saved = state(run)
    assert saved["status"] == "failed" and saved["step"] == 4
    assert finite(weights(run, 4)) and same(weights(run, 2), weights(run, 4))
    # the streak is part of the resume point: one more bad step stops a resumed run
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    _poison_loss_from(monkeypatch, calls_before=0)
    code, out, err = cli(capsys, "run.toml")
    assert code == 1 and "4 steps in a row (steps 2-5)" in one_error_line(err)


def test_a_larger_max_nonfinite_steps_rides_out_a_bad_patch(tmp_path, monkeypatch, capsys,
                                                           tiny_model):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "spread.py").write_text(SPREAD_REWARD)
    write_config(tmp_path, training={**STEPS, "max_steps": 4, "micro_batch_size": 64,
                                     "max_nonfinite_steps": 5}, data={"eval_size": 0},
                 reward={"function": "spread.py:reward"})
    _poison_loss_from(monkeypatch, calls_before=1)
    code, _, err = cli(capsys, "run.toml")
    assert code == 0, err
    assert [r["skipped_nonfinite"] for r in rows(tmp_path / "logs" / "run")] == \
        [False, True, True, True]


@pytest.fixture
def four_steps(tmp_path, monkeypatch, capsys, tiny_model):
    """A finished 4-step run (checkpoints 2 and 4) in the working folder; returns logs/run."""
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path, training={**STEPS, "max_steps": 4}, data={"eval_size": 0})
    assert cli(capsys, "run.toml")[0] == 0
    return tmp_path / "logs" / "run"


def _rewrite_weights(run_dir, step: int, value: float) -> None:
    from safetensors.torch import save_file

    ws = weights(run_dir, step)
    ws = {k: (torch.full_like(w, value) if "lora_B" in k else w) for k, w in ws.items()}
    save_file(ws, str(run_dir / "checkpoints" / f"step-{step:06d}" /
                      "adapter_model.safetensors"), metadata={"format": "pt"})


def test_resume_refuses_a_nonfinite_checkpoint_and_falls_back(four_steps, capsys):
    _rewrite_weights(four_steps, 4, float("nan"))
    code, out, err = cli(capsys, "run.toml", "--max-steps", "6")
    assert code == 0, err
    assert "non-finite" in out and "after step 2" in out, out
    assert [r["step"] for r in rows(four_steps)] == [1, 2, 3, 4, 5, 6]
    assert finite(weights(four_steps, 6))


def test_weights_that_sample_nan_are_one_line_and_resume_goes_back(four_steps, capsys):
    """S2: finite but huge weights (3e38; saved, as weight_decay = 1e12 once did) made sampling die
    in torch.multinomial on every resume. Now: one line, the checkpoint is set aside, and
    the run resumes from the last checkpoint whose sampling was finite."""
    _rewrite_weights(four_steps, 4, 3e38)
    code, _, err = cli(capsys, "run.toml", "--max-steps", "6")
    assert code == 1
    line = one_error_line(err)
    assert "weights diverged at step 4" in line and "resumes from step 2" in line, line
    assert (four_steps / "checkpoints" / "diverged-step-000004").is_dir()
    assert state(four_steps)["step"] == 2
    code, out, err = cli(capsys, "run.toml", "--max-steps", "6")
    assert code == 0, err
    assert "after step 2" in out
    assert [r["step"] for r in rows(four_steps)] == [1, 2, 3, 4, 5, 6]


def test_the_local_backend_never_saves_nonfinite_weights(tmp_path, tiny_model):
    from retrain.backends.base import DivergedError
    from retrain.backends.local.backend import LocalBackend
    from retrain.backends.local.model import LocalModel

    model = LocalModel.load(tiny_model, "float32", "cpu", 1)
    backend = LocalBackend.new_adapter(model, "a", lora_rank=2, checkpoint_dir=tmp_path)
    backend.save_state("good")
    with torch.no_grad():
        next(iter(backend.params.values())).view(-1)[0] = float("inf")
    with pytest.raises(DivergedError, match="not finite"):
        backend.save_state("bad")
    assert not (tmp_path / "bad").exists() and not any(tmp_path.glob(".bad*"))
    shutil.rmtree(tmp_path / "good")


def test_serve_does_not_apply_a_nonfinite_step_and_says_so(tmp_path, sdk_env, tiny_engine):
    """A client's finite inputs whose loss overflows (sampler log-probs of -1e4 make the
    importance ratio inf): the step is not applied and the optim_step reply says so."""
    tinker = pytest.importorskip("tinker")
    from tinker import types

    from tests.serve_doubles import Served

    with Served(tiny_engine, tmp_path, hold_s=2.0) as served:
        service = tinker.ServiceClient(base_url=served.url)
        tc = service.create_lora_training_client(base_model="tiny-random", rank=4,
                                                 seed=2).result()
        tokens = tc.get_tokenizer().encode("the cat sat on the mat")
        n = len(tokens) - 1
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:],
                                            "logprobs": [-1e4] * n, "advantages": [1.0] * n})
        probe = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n})
        before = tc.forward([probe], "cross_entropy").result().metrics["loss:sum"]
        tc.forward_backward([datum], "importance_sampling").result()
        step = tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
        assert step.metrics["skipped_nonfinite"] == 1.0 and step.metrics["skipped"] == 1.0
        after = tc.forward([probe], "cross_entropy").result().metrics["loss:sum"]
        assert after == before  # the weights did not move
        # and the adapter still trains on sound input
        datum.loss_fn_inputs["logprobs"] = types.TensorData(data=[-1.0] * n, dtype="float32")
        tc.forward_backward([datum], "importance_sampling").result()
        step = tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
        assert step.metrics["skipped_nonfinite"] == 0.0 and math.isfinite(step.metrics["grad_norm"])
        # settings that make AdamW overflow the weights are refused, naming the field (last:
        # a refused request leaves a gap in the SDK's order that later calls would wait on)
        with pytest.raises(tinker.BadRequestError, match="learning_rate x weight_decay"):
            tc.optim_step(types.AdamParams(learning_rate=1e-3, weight_decay=1e12)).result()
        service.close("success").result()


@pytest.mark.parametrize("adam, words", [
    ({"learning_rate": 1e39}, "does not fit the float32 weights"),
    ({"learning_rate": 1e-4, "weight_decay": 1e4}, "learning_rate x weight_decay = 1 must be"),
])
def test_serve_refuses_adam_settings_that_overflow(adam, words):
    """S2 on serve's side: lr beyond float32 made torch raise (a 500); lr x weight_decay >= 1
    grows the weights without bound."""
    from retrain.backends.base import AdamParams
    from retrain.serve.door.validate import RequestError, check_adam

    with pytest.raises(RequestError, match=words):
        check_adam(AdamParams(**adam))


def test_tinker_run_reports_a_skipped_step_and_its_staleness(tiny_server, tmp_path, sdk_env,
                                                             monkeypatch, capsys):
    """The tinker backend against `retrain serve` (the loss poisoned on the server from step
    2 on): the rows say skipped_nonfinite, and a skipped update does not count in the next
    batch's sample_staleness (off-policy sampling ahead)."""
    pytest.importorskip("tinker")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "spread.py").write_text(SPREAD_REWARD)
    write_config(tmp_path, training={**STEPS, "max_steps": 4, "micro_batch_size": 64,
                                     "max_steps_off_policy": 1, "max_nonfinite_steps": 5},
                 data={"eval_size": 0}, reward={"function": "spread.py:reward"},
                 backend={"backend": "tinker", "base_url": tiny_server.url})
    _poison_loss_from(monkeypatch, calls_before=1)
    code, out, err = cli(capsys, "run.toml")
    assert code == 0, err
    got = rows(tmp_path / "logs" / "run")
    assert [r["skipped_nonfinite"] for r in got] == [False, True, True, True]
    assert [r["sample_staleness"] for r in got] == [0, 1, 0, 0]


@pytest.mark.parametrize("setting, words", [
    ("training.weight_decay=1e12", ["training.weight_decay", "1 / lr"]),  # S2
    ("training.lr=1e30", ["training.lr", "must be <= 1"]),                # S2
    ("training.temperature=1e-300", ["training.temperature", ">= 0.01"]),  # S3
])
def test_settings_that_make_adamw_or_sampling_overflow_fail_fast(tmp_path, monkeypatch, capsys,
                                                                 setting, words):
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path)
    for command in (["run.toml"], ["explain", "run.toml"]):
        code, _, err = cli(capsys, *command, "--set", setting)
        assert code == 2
        line = one_error_line(err)
        assert all(w in line for w in words), line
    assert not (tmp_path / "logs").exists()


def test_explain_warns_about_an_absurd_learning_rate(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path, training={"lr": 0.5})
    code, out, _ = cli(capsys, "explain", "run.toml")
    assert code == 0 and "training.lr = 0.5 is far above" in out, out


def test_a_tiny_temperature_samples_greedily_instead_of_overflowing(tiny_model):
    """S3 in the sampler (serve clients may send any temperature > 0): logits / 1e-300
    overflowed float32 and torch.multinomial died."""
    from retrain.backends.base import SamplingParams
    from retrain.backends.local.backend import LocalBackend
    from retrain.backends.local.model import LocalModel

    model = LocalModel.load(tiny_model, "float32", "cpu", 1)
    backend = LocalBackend.new_adapter(model, "t", lora_rank=2)
    prompt = [[1, 5, 9, 13]]
    greedy = backend.sample(prompt, 1, SamplingParams(max_tokens=6, temperature=0.0))[0][0]
    cold = backend.sample(prompt, 2, SamplingParams(max_tokens=6, temperature=1e-300,
                                                    seed=4))[0]
    for c in cold:
        assert c.tokens == greedy.tokens and all(lp == 0.0 for lp in c.logprobs)


# ----------------------------------------------------------------------- TOML syntax (item 8)

TOML_KEY_CASES = [
    ("[training]\nlr = 1e-4\n\nlr = 2e-4\n", "run.toml:4:1:", ["duplicate key 'training.lr'",
                                                                "first set on line 2"]),
    ('[training]\nbatch_size = 2\n  "batch_size" = 3\n', "run.toml:3:3:",
     ["duplicate key 'training.batch_size'"]),
    ("[training]\nlr = 1e-4\n[training]\n", "run.toml:3:", ["table [training]"]),
    ("[training]\nlé = 1\n", "run.toml:2:2:", ["bare key 'lé'", "non-ASCII", '"lé"']),
    ("[trainïng]\nlr = 1\n", "run.toml:1:7:", ["bare key 'trainïng'", "non-ASCII"]),
]


@pytest.mark.parametrize("text, where, words", TOML_KEY_CASES)
def test_toml_syntax_errors_name_the_key_and_the_place(tmp_path, monkeypatch, capsys, text,
                                                       where, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text(text, encoding="utf-8")
    code, _, err = cli(capsys, "explain", "run.toml")
    assert code == 2
    line = one_error_line(err)
    assert line.startswith(f"error: {where}"), line
    assert all(w in line for w in words), line


# ------------------------------------------------------------------ library warnings (item 9)


def test_a_short_run_prints_no_library_warning(tmp_path, cli_env, python, tiny_model):
    """`make demo` printed transformers' FutureWarning (`past_key_values` is deprecated): the
    KV cache is now passed under the name the installed transformers takes. Warnings are
    turned on in the subprocess (-W default) so that a hidden one would show too."""
    import subprocess

    write_config(tmp_path, training={**STEPS, "max_steps": 2}, data={"eval_size": 4})
    done = subprocess.run([python, "-W", "default", "-m", "retrain", "run.toml"], cwd=tmp_path,
                          env=cli_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for text in (done.stdout, done.stderr):
        assert "Warning" not in text, text


# ---------------------------------------------------------------------- Ctrl-C at start-up (S6)


def test_ctrl_c_at_any_moment_of_start_up_exits_130_quietly(tmp_path, cli_env, python,
                                                             tiny_model):
    """S6: Ctrl-C about 1 s in, while transformers imports, printed a 123-line chained
    traceback and exited 1 (or aborted in C++). Several delays cover the imports, the model
    load and the first step."""
    import signal
    import subprocess
    import time

    write_config(tmp_path, training={**STEPS, "max_steps": 50}, data={"eval_size": 0})
    for delay in (0.3, 0.7, 1.0, 1.3, 1.6, 2.0, 2.5, 3.5):
        proc = subprocess.Popen([python, "-m", "retrain", "run.toml"], cwd=tmp_path,
                                env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, (delay, proc.returncode, err[-2000:])
        assert "Traceback" not in err and len(err.strip().splitlines()) <= 3, (delay, err)


# ------------------------------------------------------------------ two writers on one run (S9)


def test_two_processes_on_one_run_folder_one_refuses(tmp_path, cli_env, python, tiny_model):
    """S9: two `retrain run.toml` started together both trained into one folder (step 1
    twice in the metrics). Now one trains and the other says so in one line, exit 2."""
    import subprocess

    write_config(tmp_path, training={**STEPS, "max_steps": 3}, data={"eval_size": 0})
    procs = [warm.Popen([python, "-m", "retrain", "run.toml"], cwd=tmp_path, env=cli_env,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    done = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in done)
    assert codes == [0, 2], done
    refused = next(err for code, _, err in done if code == 2)
    line = one_error_line(refused)
    assert "being trained by another process (pid" in line, line
    assert [r["step"] for r in rows(tmp_path / "logs" / "run")] == [1, 2, 3]


def test_a_sigkilled_run_does_not_block_the_next_start(tmp_path, monkeypatch, capsys, cli_env,
                                                       python, tiny_model):
    import signal
    import subprocess

    write_config(tmp_path, training={**STEPS, "max_steps": 40}, data={"eval_size": 0})
    counter = tmp_path / "calls"  # step 3's first reward call blocks: killed after step 2
    env = dict(cli_env, RETRAIN_TEST_COUNTER=str(counter), RETRAIN_TEST_BLOCK_AFTER=str(2 * 8))
    proc = warm.Popen([python, "-m", "retrain", "run.toml"], cwd=tmp_path, env=env,
                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        wait_for(lambda: counter.exists() and int(counter.read_text() or 0) > 2 * 8, proc)
        assert state(tmp_path / "logs" / "run")["step"] == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "run.toml", "--max-steps", "4")
    assert code == 0, err
    assert "resuming" in out
    assert [r["step"] for r in rows(tmp_path / "logs" / "run")] == [1, 2, 3, 4]


# --------------------------------------------------------- a damaged batch sampled ahead (S10)


def _index_out_of_range(batch: dict) -> None:
    batch["index"][0] = 10**6


def _token_out_of_vocab(batch: dict) -> None:
    batch["groups"][0][0]["tokens"][0] = 10**9


PREFETCH_DAMAGE = {
    "prompt index out of range": lambda p: p.write_text(json.dumps(
        _edited(p, _index_out_of_range))),
    "token id out of the vocabulary": lambda p: p.write_text(json.dumps(
        _edited(p, _token_out_of_vocab))),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:60]),
}


def _edited(path, change) -> dict:
    batch = json.loads(path.read_text())
    change(batch)
    return batch


@pytest.mark.parametrize("damage", list(PREFETCH_DAMAGE))
def test_a_damaged_prefetched_batch_is_sampled_afresh_with_a_note(
        tiny_server, tmp_path, sdk_env, monkeypatch, capsys, damage):
    """S10: an off-policy run whose saved batch for the next step was damaged failed on
    every resume with IndexError. Now the batch is checked and, if damaged (or torn),
    dropped with one line; the step samples afresh."""
    pytest.importorskip("tinker")
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path, training={**STEPS, "max_steps": 4, "save_every": 1,
                                     "max_steps_off_policy": 1}, data={"eval_size": 0},
                 backend={"backend": "tinker", "base_url": tiny_server.url})
    assert cli(capsys, "run.toml")[0] == 0
    run = tmp_path / "logs" / "run"
    point = run / "checkpoints" / "step-000003.json"   # resume after step 3 ...
    (run / "checkpoints" / "step-000004.json").unlink()
    (run / "state.json").write_text(json.dumps({**json.loads(point.read_text()),
                                                "status": "interrupted"}))
    batch = run / json.loads(point.read_text())["extra"]["prefetched_batch"]
    assert batch.name == "step-000004.json"            # ... with step 4's batch damaged
    PREFETCH_DAMAGE[damage](batch)
    code, out, err = cli(capsys, "run.toml")
    assert code == 0, err
    notes = [line for line in out.splitlines() if "sampled ahead for step 4" in line]
    assert len(notes) == 1 and "afresh" in notes[0], out
    assert [r["step"] for r in rows(run)] == [1, 2, 3, 4]


# ------------------------------------------------------------------------ run names (S11)


@pytest.mark.parametrize("name", ["..", "../x", "/tmp/elsewhere", ".", "a/b"])
def test_a_run_name_that_leaves_the_log_folder_is_refused(tmp_path, monkeypatch, capsys, name):
    """S11: logging.run_name = ".." made the working folder the run folder (config.toml,
    state.json and checkpoints written beside the user's files)."""
    monkeypatch.chdir(tmp_path)
    write_config(tmp_path, logging={"log_dir": "logs", "run_name": name})
    before = sorted(p.name for p in tmp_path.iterdir())
    for command in (["run.toml"], ["explain", "run.toml"]):
        code, _, err = cli(capsys, *command)
        assert code == 2
        line = one_error_line(err)
        assert "logging.run_name" in line and "plain folder name" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def _campaign(tmp_path, conditions: str) -> None:
    write_config(tmp_path)
    text = (tmp_path / "run.toml").read_text()
    (tmp_path / "camp.toml").write_text(text + "\n[campaign]\nseeds = [1]\n" + conditions,
                                        encoding="utf-8")


def test_an_empty_condition_name_is_an_error(tmp_path, monkeypatch, capsys):
    """S11: `name = ""` silently became "base-2"."""
    monkeypatch.chdir(tmp_path)
    _campaign(tmp_path, '[[campaign.conditions]]\nname = "a"\n\n'
                        '[[campaign.conditions]]\nname = ""\n"training.lr" = 1e-4\n')
    code, _, err = cli(capsys, "explain", "camp.toml")
    assert code == 2
    line = one_error_line(err)
    assert "campaign.conditions[1].name" in line and "no letter or digit" in line, line


def test_unicode_condition_names_keep_their_letters(tmp_path, monkeypatch, capsys):
    """S11: "ünïcödé-名前" became "n-c-d"."""
    monkeypatch.chdir(tmp_path)
    _campaign(tmp_path, '[[campaign.conditions]]\nname = "ünïcödé-名前"\n'
                        '"training.lr" = 1e-4\n\n[[campaign.conditions]]\nname = "a/b:c"\n'
                        '"training.lr" = 2e-4\n')
    code, out, err = cli(capsys, "explain", "camp.toml", "--json")
    assert code == 0, err
    names = sorted(r["name"] for r in json.loads(out)["runs"])
    assert names == ["a-b-c_s1", "ünïcödé-名前_s1"], names


OVERFLOW_ENV = '''
from retrain.environments import Environment, Step


class Overflow(Environment):
    """Two turns of 1e308 each: finite step rewards whose sum is inf."""

    def reset(self, seed):
        self.turn = 0
        return [{"role": "user", "content": f"Say anything ({seed})."}]

    def step(self, reply):
        self.turn += 1
        big = 1e308 if len(reply) % 2 else 1.0
        return Step(messages=[{"role": "user", "content": "again"}], reward=big,
                    done=self.turn >= 2)
'''


def test_environment_rewards_that_sum_to_inf_are_environment_errors(tmp_path, monkeypatch,
                                                                   capsys, tiny_model):
    """Item 1 for multi-turn environments: an episode's reward sum that overflows became inf
    and compute_advantages raised (a traceback). Now it is an environment error, scored as
    environment.on_env_error says, and the run trains on."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "overflow_env.py").write_text(OVERFLOW_ENV)
    write_config(tmp_path, environment={"kind": "python", "factory": "overflow_env.py:Overflow",
                                        "on_length": "continue"},
                 data={"eval_size": 0},
                 training={**STEPS, "max_steps": 2, "batch_size": 1, "max_tokens": 5})
    code, out, err = cli(capsys, "run.toml")
    assert code == 0, err
    got = rows(tmp_path / "logs" / "run")
    assert sum(r["env_errors"] for r in got) > 0, got
    for row in got:
        assert math.isfinite(row["mean_reward"]) and row["skipped_nonfinite"] is False, row
    assert "beyond a float" in out + err


def test_the_tinker_backend_reports_a_nonfinite_grad_norm_as_skipped(tmp_path, sdk_env,
                                                                     tiny_model):
    """A service that reports a NaN gradient norm but not whether it skipped the step (a
    stand-in for the hosted service, which cannot run here): the tinker backend says
    skipped_nonfinite, so the trainer's row and streak count it."""
    pytest.importorskip("tinker")
    from retrain.backends.base import AdamParams, LossConfig, make_datum
    from retrain.backends.base import Completion as C
    from retrain.backends.tinker.backend import TinkerBackend
    from tests.serve_doubles import BigramEngine, Served

    class NanNorm(BigramEngine):
        def optim_step(self, model_id, adam):
            metrics = super().optim_step(model_id, adam)
            metrics.pop("skipped_nonfinite", None)
            return {**metrics, "grad_norm:mean": math.nan}

    with Served(NanNorm(vocab=260, eos=2, tokenizer_id=tiny_model), tmp_path,
                hold_s=2.0) as served:
        backend = TinkerBackend(base_model="bigram-test", lora_rank=4, seed=5,
                                base_url=served.url, request_timeout_s=30)
        try:
            datum = make_datum([1, 70, 71], C([72, 73], [-1.0, -1.0], "length"), 1.0)
            backend.forward_backward([datum], LossConfig())
            out = backend.optim_step(AdamParams(learning_rate=0.1))
            assert math.isnan(out.grad_norm) and out.metrics["skipped_nonfinite"] == 1.0
        finally:
            backend.close()

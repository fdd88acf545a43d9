"""`retrain eval`, `retrain sample` and `retrain export` on a real tiny run: eval repeats the
trainer's own evaluation exactly, sample loads no training code, export round-trips through
plain transformers and peft in a fresh process, bad input changes nothing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("scipy")

from retrain.cli.app import run_app  # noqa: E402
from retrain.config.loader import load_config  # noqa: E402
from retrain.results.evaluate import EvalRequest, evaluate  # noqa: E402
from tests import warm  # noqa: E402
from tests.results_helpers import snapshot  # noqa: E402
from tests.run_helpers import rows, write_config  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model):
    """4 steps of the tiny model on the digits reward, eval every 2 steps, every checkpoint
    kept."""
    folder = tmp_path_factory.mktemp("results-run")
    path = write_config(folder, training={"max_steps": 4, "eval_every": 2, "save_every": 1},
                        data={"eval_size": 8}, logging={"log_dir": str(folder / "logs")})
    assert run_app(["run", str(path)]) == 0  # as a user runs it: file references anchored
    return folder / "logs" / "run"


def _trainer_texts(run, step):
    """Greedy held-out completions at checkpoint `step` along the trainer's own path: its
    backend restored by load_state, prompts and batches as Trainer._evaluate makes them."""
    from retrain.backends import create_backend
    from retrain.backends.base import SamplingParams
    from retrain.environments.tasks import load_task, render_prompt

    cfg = load_config(run / "config.toml")
    backend = create_backend(cfg.model, cfg.training, cfg.backend,
                             keep_reference=cfg.algorithm.kl_coef > 0, config_dir=run,
                             checkpoint_dir=run / "checkpoints")
    backend.load_state(str(run / "checkpoints" / f"step-{step:06d}"))
    held = load_task(cfg.data, cfg.training.seed, run).eval
    prompts = [render_prompt(backend.tokenizer, p, cfg.data) for p in held]
    chunk = max(16, cfg.training.batch_size * cfg.training.group_size)
    greedy = SamplingParams(max_tokens=cfg.training.max_tokens, temperature=0.0)
    texts = []
    for i in range(0, len(prompts), chunk):
        texts += [backend.tokenizer.decode(g[0].tokens, skip_special_tokens=True)
                  for g in backend.sample(prompts[i:i + chunk], 1, greedy)]
    return texts


def _trainer_sampled_texts(run, step, k, temperature):
    """The k sampled completions per held-out problem the trainer's eval_samples draw at
    checkpoint `step` (run/eval.py's sample_k over the trainer's backend)."""
    from retrain.backends import create_backend
    from retrain.environments.tasks import load_task, render_prompt
    from retrain.run.eval import sample_k, sampled_params

    cfg = load_config(run / "config.toml")
    backend = create_backend(cfg.model, cfg.training, cfg.backend, keep_reference=False,
                             config_dir=run, checkpoint_dir=run / "checkpoints")
    backend.load_state(str(run / "checkpoints" / f"step-{step:06d}"))
    held = load_task(cfg.data, cfg.training.seed, run).eval
    prompts = [render_prompt(backend.tokenizer, p, cfg.data) for p in held]
    rows = max(16, cfg.training.batch_size * cfg.training.group_size)
    groups = sample_k(backend.sample, prompts, k, sampled_params(cfg.training, temperature),
                      rows)
    return [backend.tokenizer.decode(c.tokens, skip_special_tokens=True)
            for g in groups for c in g]


def test_sampled_eval_draws_what_the_trainers_eval_samples_draw(run_dir):
    """--samples k repeats the trainer's sampled eval (same seeds, batches, draws), so its
    eval_mean_at_k is the run's row; the figures as its evals file gives them by hand."""
    report = evaluate(run_dir, EvalRequest(step=2, samples=5, temperature=1.0))
    records = [json.loads(line) for line in Path(report.file).read_text().splitlines()]
    texts = [r["completion"] for r in records]
    assert texts == _trainer_sampled_texts(run_dir, 2, 5, 1.0)
    assert len(set(texts)) > len(texts) // 2  # sampled, not one answer repeated
    rates = [sum(r["correct"] for r in records[i * 5:(i + 1) * 5]) / 5 for i in range(8)]
    assert report.eval_mean_at_k == pytest.approx(sum(rates) / 8)
    assert report.eval_pass_at_k == sum(1 for r in rates if r) / 8


def _without_evals(run):
    return {k: v for k, v in snapshot(run).items() if not k.startswith("evals/")}


def test_eval_repeats_the_runs_own_evaluation_exactly(run_dir):
    logged = {r["step"]: r["eval_accuracy"] for r in rows(run_dir) if "eval_accuracy" in r}
    assert sorted(logged) == [2, 4]
    for step in (2, 4):
        report = evaluate(run_dir, EvalRequest(step=step))
        assert report.accuracy.value == logged[step]
        records = [json.loads(line) for line in Path(report.file).read_text().splitlines()]
        assert [r["completion"] for r in records] == _trainer_texts(run_dir, step)
    assert _trainer_texts(run_dir, 1) != _trainer_texts(run_dir, 4)  # the step matters


def test_eval_writes_only_its_evals_file(run_dir, capsys):
    before = _without_evals(run_dir)
    assert run_app(["eval", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "heldout at step 4: accuracy" in out and "exact binomial 95% interval" in out
    lines = (run_dir / "evals" / "heldout-step4.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 8
    assert set(records[0]) == {"prompt", "completion", "answer", "reward", "correct"}
    assert _without_evals(run_dir) == before


def test_sampled_eval_reports_pass_at_1_and_pass_at_k(run_dir, tmp_path, capsys):
    data = tmp_path / "probs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": i + 1}) + "\n"
                            for i in range(5)))
    code = run_app(["eval", str(run_dir), "--step", "2", "--data", str(data), "--samples", "3",
                    "--temperature", "1.0", "--reward", "match", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["step"], report["problems"], report["samples"]) == (2, 5, 3)
    assert report["reward"] == "match" and report["pass_at_1"]["n"] == 5
    from scipy import stats

    k, n = report["accuracy"]["k"], report["accuracy"]["n"]
    lo = stats.beta.ppf(0.025, k, n - k + 1) if k else 0.0
    hi = stats.beta.ppf(0.975, k + 1, n - k) if k < n else 1.0
    assert (report["accuracy"]["lo"], report["accuracy"]["hi"]) == pytest.approx((lo, hi))
    file = Path(report["file"])
    assert file.parent == run_dir / "evals"
    assert re.fullmatch(r"probs-[0-9a-f]{8}-step2-k3-t1\.jsonl", file.name), file.name
    written = file.read_text().splitlines()
    assert len(written) == 15 and {json.loads(x)["sample"] for x in written} == {0, 1, 2}


def test_two_data_files_of_one_name_keep_their_own_results(run_dir, tmp_path, capsys):
    files = []
    for folder, offset in (("a", 0), ("b", 50)):
        data = tmp_path / folder / "x.jsonl"
        data.parent.mkdir()
        data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": i + 1})
                                + "\n" for i in range(offset, offset + 3)))
        assert run_app(["eval", str(run_dir), "--data", str(data), "--json"]) == 0
        files.append(Path(json.loads(capsys.readouterr().out)["file"]))
    assert files[0] != files[1] and all(f.name.startswith("x-") for f in files)
    prompts = [[json.loads(line)["prompt"] for line in f.read_text().splitlines()]
               for f in files]
    assert "0 + 1" in prompts[0][0] and "50 + 1" in prompts[1][0]


def test_many_samples_decode_at_most_a_training_steps_rows_at_a_time(run_dir, tmp_path,
                                                                     monkeypatch):
    """--samples 40 with 5 problems: never 200 rows in one decode (all of them for 8 problems
    and --samples 100000 was 14 GB), at most a step's 16; every sample its own draw."""
    from retrain.results.policy import LocalPolicy

    decodes, real = [], LocalPolicy.sample

    def spy(self, prompts, n, params, chunk=64):
        out = real(self, prompts, n, params, chunk)
        decodes.extend(min(chunk, len(prompts) - i) * n for i in range(0, len(prompts), chunk))
        return out

    monkeypatch.setattr(LocalPolicy, "sample", spy)
    data = tmp_path / "five.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + 1?", "answer": i + 1}) + "\n"
                            for i in range(5)))
    report = evaluate(run_dir, EvalRequest(data=data, samples=40, temperature=1.0))
    assert sum(decodes) == 200 and max(decodes) <= 16, decodes
    records = [json.loads(x) for x in Path(report.file).read_text().splitlines()]
    assert [r["sample"] for r in records[:40]] == list(range(40))
    assert len({r["completion"] for r in records[:40]}) > 20  # the later pieces are new draws


@pytest.mark.parametrize("args, message", [
    (["--step", "99"], "--step 99: "),
    (["--task", "nope"], "--task 'nope': not a built-in task"),
    (["--data", "/no/such.jsonl"], "/no/such.jsonl does not exist"),
    (["--samples", "0"], "--samples 0"),
    (["--samples", "100000", "--temperature", "1"], "--samples 100000: give a number from 1 to "
                                                    "1024"),
    (["--samples", "2", "--temperature", "0"], "--samples > 1 needs --temperature > 0"),
    (["--reward", "nope"], "--reward: "),
    (["--task", "countdown", "--data", "x.jsonl"], "not both"),
])
def test_bad_eval_input_is_one_error_line_and_changes_nothing(run_dir, capsys, args, message):
    before = snapshot(run_dir)
    assert run_app(["eval", str(run_dir), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    assert snapshot(run_dir) == before


def test_eval_refuses_a_problem_longer_than_the_models_context(run_dir, tmp_path, capsys):
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n"
                    + json.dumps({"prompt": "x" * 3000, "answer": "3"}) + "\n")
    before = snapshot(run_dir)
    assert run_app(["eval", str(run_dir), "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --data {data}: problem 2: prompt (") and \
        "exceeds the model's context of 1024 tokens" in err and len(err.strip().splitlines()) == 1
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("command", [["eval"], ["sample", "hi"], ["export", "OUT"]])
def test_not_a_run_folder(tmp_path, capsys, command):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "manifest.json").write_text("{}")
    args = [command[0], str(tmp_path / "c"), *command[1:]]
    assert run_app(args) == 2
    err = capsys.readouterr().err
    assert "not a run folder" in err and "give one of its runs" in err
    assert run_app([command[0], str(tmp_path / "nope"), *command[1:]]) == 2
    assert "no such run folder" in capsys.readouterr().err


# ---------------------------------------------------------------------------- sample

TRAINING_CODE = ("retrain.run.trainer", "retrain.cli.launch", "retrain.run.checkpoint",
                 "retrain.algorithms.advantages",
                 "retrain.backends.local.backend", "retrain.backends.local.training.micro_batches",
                 "retrain.run.eval",
                 "retrain.environments.scorer", "retrain.control.backpressure.controller",
                 "retrain.campaign.runner", "retrain.campaign.executor", "retrain.run.offpolicy",
                 "retrain.results.evaluate", "retrain.run.trackers", "retrain.run.step_row")


def test_sample_answers_and_imports_no_training_code(run_dir, cli_env):
    script = ("import sys\nfrom retrain.cli.app import run_app\n"
              f"code = run_app(['sample', {str(run_dir)!r}, 'What is 2 + 2?', '--temperature',"
              " '0', '--max-tokens', '6'])\n"
              "print('\\nMODULES', sorted(m for m in sys.modules if m.startswith('retrain')))\n"
              "sys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", script], env=cli_env, text=True,
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    answer, modules = done.stdout.split("\nMODULES ")
    assert answer.strip(), done.stdout
    loaded = eval(modules)  # noqa: S307 (our own printed list)
    assert "retrain.results.policy" in loaded
    assert not [m for m in loaded if m in TRAINING_CODE], loaded


def test_sample_is_deterministic_when_greedy_and_takes_the_step(run_dir, capsys):
    outs = []
    for step in ("4", "4", "1"):
        assert run_app(["sample", str(run_dir), "hello", "--temperature", "0", "--step", step,
                        "--max-tokens", "8"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].strip()


def test_interactive_sample_is_a_chat_loop(run_dir, cli_env):
    done = warm.run([sys.executable, "-m", "retrain", "sample", str(run_dir),
                     "--interactive", "--max-tokens", "4"], input="hi\n\nagain\nexit\n",
                    env=cli_env, text=True, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("> ") == 4 and "Ctrl-D or 'exit' ends" in done.stdout


@pytest.mark.parametrize("args, message", [
    ([], "give a prompt"),
    (["x", "--interactive"], "not both"),
    (["x", "--max-tokens", "0"], "--max-tokens 0"),
    (["x", "--temperature", "-1"], "--temperature -1"),
    (["x", "--step", "77"], "--step 77"),
    (["x", "--max-tokens", "1000000000"], "max_tokens (1000000000) exceeds the model's context "
                                          "of 1024 tokens; shorten it or give a smaller"),
    (["x" * 3000, "--max-tokens", "4"], "the prompt: prompt (30"),
])
def test_bad_sample_input(run_dir, capsys, args, message):
    before = snapshot(run_dir)
    assert run_app(["sample", str(run_dir), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    assert snapshot(run_dir) == before


# ---------------------------------------------------------------------------- export

# Runs in a fresh interpreter where importing retrain fails: what a user without retrain has.
LOAD_AND_SCORE = r"""
import json, sys
sys.modules["retrain"] = None  # any import of retrain now raises ImportError
import torch
loader, folder, out = sys.argv[1:4]
if loader == "transformers":
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
else:
    from peft import AutoPeftModelForCausalLM
    model = AutoPeftModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
from transformers import AutoTokenizer
ids = AutoTokenizer.from_pretrained(folder)("What is 3 + 4?")["input_ids"]
with torch.no_grad():
    logits = model.eval()(input_ids=torch.tensor([ids])).logits[0]
json.dump({"ids": ids, "logits": logits.tolist()}, open(out, "w"))
"""


def _peft_logits(run, step, ids):
    """Logits of the checkpoint as peft builds it from the run's files, float32."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = json.loads((run / "checkpoints" / f"step-{step:06d}" /
                      "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(cfg["base_model_name_or_path"],
                                                dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(input_ids=torch.tensor([ids])).logits[0]
        model = PeftModel.from_pretrained(base, str(run / "checkpoints" / f"step-{step:06d}"))
        return model.eval()(input_ids=torch.tensor([ids])).logits[0], base_logits


def _fresh_logits(loader, folder, tmp_path, cli_env):
    env = {k: v for k, v in cli_env.items() if k != "PYTHONPATH"}
    out = tmp_path / f"{loader}.json"
    done = subprocess.run([sys.executable, "-c", LOAD_AND_SCORE, loader, str(folder), str(out)],
                          env=env, cwd=tmp_path, text=True, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind, loader", [("merged", "transformers"), ("adapter", "peft"),
                                          ("adapter", "transformers")])
def test_export_round_trip_in_a_fresh_process(run_dir, tmp_path, cli_env, capsys, kind,
                                              loader):
    import torch

    out = tmp_path / f"export-{kind}"
    before = snapshot(run_dir)
    args = ["export", str(run_dir), str(out), "--step", "4"] + (["--merged"] if kind ==
                                                                 "merged" else [])
    assert run_app(args) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert snapshot(run_dir) == before
    names = {p.name for p in out.iterdir()}
    assert {"README.md", "tokenizer_config.json"} <= names
    assert ({"config.json", "model.safetensors", "generation_config.json"} if kind == "merged"
            else {"adapter_model.safetensors", "adapter_config.json"}) <= names
    assert "optimizer.pt" not in names
    got = _fresh_logits(loader, out, tmp_path, cli_env)
    want, base = _peft_logits(run_dir, 4, got["ids"])
    assert not torch.allclose(want, base, atol=1e-4)  # the adapter changes the logits
    torch.testing.assert_close(torch.tensor(got["logits"]), want, atol=1e-4, rtol=0)


def test_model_card_says_what_was_trained(run_dir, tmp_path):
    assert run_app(["eval", str(run_dir), "--step", "2"]) == 0
    out = tmp_path / "card"
    assert run_app(["export", str(run_dir), str(out), "--step", "2"]) == 0
    card = (out / "README.md").read_text()
    assert "library_name: peft" in card and "step 2 of 4" in card
    assert "AutoPeftModelForCausalLM" in card and "[training]" in card
    assert "- `eval_accuracy`: 0 (step 2)" in card and "`heldout-step2`: 0/8 correct" in card
    assert "step 4)" not in card  # metrics after the exported step are not its metrics


def test_bad_export_input_changes_nothing(run_dir, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep")
    before = snapshot(run_dir)
    for args, message in (([str(taken)], "already exists"),
                          ([str(run_dir / "inside")], "inside the run folder"),
                          ([str(tmp_path / "x"), "--step", "99"], "--step 99")):
        assert run_app(["export", str(run_dir), *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, err
        assert len(err.strip().splitlines()) == 1
    assert snapshot(run_dir) == before and (taken / "mine.txt").read_text() == "keep"
    assert not (tmp_path / "x").exists() and not (tmp_path / ".x.tmp").exists()


def test_eval_without_a_held_out_split_says_what_to_give(run_dir, tmp_path, capsys):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("evals"))  # earlier tests
    config = copy / "config.toml"
    config.write_text(config.read_text().replace("eval_size = 8", "eval_size = 0"))
    assert run_app(["eval", str(copy)]) == 2
    err = capsys.readouterr().err
    assert "no held-out split (data.eval_size = 0)" in err and "--data FILE.jsonl" in err
    assert not (copy / "evals").exists()

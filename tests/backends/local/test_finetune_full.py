"""`model.finetune = "full"` on the tiny model: every weight trains with AdamW states for all,
checkpoints resume exactly (also after SIGKILL), the KL reference is a frozen copy of the base,
and `retrain eval`, `sample` and `export` work on the run; the export loads in plain
transformers in a fresh process. (Config refusals: test_recipe_config; explain's memory:
test_explain_memory.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from retrain.backends.base import (  # noqa: E402
    AdamParams,
    BackendError,
    LossConfig,
    SamplingParams,
    make_datum,
)
from retrain.backends.local.full import FullBackend  # noqa: E402
from retrain.backends.local.model import LocalModel  # noqa: E402
from retrain.cli.app import run_app  # noqa: E402
from retrain.errors import UserError  # noqa: E402
from tests.run_helpers import kill_after_step_3_and_resume, rows, same_rows, write_config  # noqa: E402

FULL = {"finetune": "full"}


def _backend(tiny_model, tmp_path, **kw) -> FullBackend:
    """A fresh model per test: full fine-tuning changes the weights themselves."""
    return FullBackend(LocalModel.load(tiny_model, "float32", "cpu", 1), seed=7,
                       checkpoint_dir=tmp_path, **kw)


def _datums(backend, seed=1):
    prompt = backend.tokenizer("what is 2 + 2?")["input_ids"]
    [group] = backend.sample([prompt], 4, SamplingParams(max_tokens=8, seed=seed))
    return [make_datum(prompt, c, (-1.0) ** j) for j, c in enumerate(group)]


def _step(backend, seed):
    out = backend.forward_backward(_datums(backend, seed), LossConfig())
    backend.optim_step(AdamParams(learning_rate=1e-2))
    return out.loss


def _max_diff(a, b) -> float:
    return max(abs(x - y) for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))


# ---------------------------------------------------------------------------- the backend

def test_a_step_moves_every_weight_with_adamw_states_for_all(tiny_model, tmp_path):
    backend = _backend(tiny_model, tmp_path)
    params = dict(backend.model.base.named_parameters())
    assert backend.params.keys() == params.keys() and len(params) > 10
    assert backend.model.peft is None  # no adapter anywhere
    before = {k: v.detach().clone() for k, v in params.items()}
    datums = _datums(backend)
    lp_before = backend.logprobs(datums)
    backend.forward_backward(datums, LossConfig())
    out = backend.optim_step(AdamParams(learning_rate=1e-2, grad_clip_norm=1.0))
    assert out.grad_norm > 0 and out.metrics["skipped"] == 0.0
    assert [k for k, v in params.items() if torch.equal(v, before[k])] == []
    assert len(backend.optimizer.state) == len(params)
    assert all(set(s) >= {"exp_avg", "exp_avg_sq"} for s in backend.optimizer.state.values())
    assert _max_diff(backend.logprobs(datums), lp_before) > 1e-3


def test_save_and_load_state_resume_exactly(tiny_model, tmp_path):
    backend = _backend(tiny_model, tmp_path)
    _step(backend, 1)
    ref = backend.save_state("step-1")
    assert sorted(p.name for p in Path(ref).iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "optimizer.pt", "rng.pt"]
    expected = [_step(backend, s) for s in (2, 3)]
    weights = {k: v.detach().clone() for k, v in backend.params.items()}
    backend.load_state(ref)
    assert [_step(backend, s) for s in (2, 3)] == expected
    assert all(torch.equal(v, weights[k]) for k, v in backend.params.items())
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp folders left


def test_a_checkpoint_of_another_model_is_refused(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    backend = _backend(tiny_model, tmp_path)
    ref = Path(backend.save_state("step-1"))
    weights = load_file(str(ref / "model.safetensors"))
    weights["model.extra.weight"] = weights.pop("model.norm.weight")
    save_file(weights, str(ref / "model.safetensors"))
    with pytest.raises(BackendError, match="does not match the model"):
        backend.load_state(str(ref))


def test_the_checkpoint_is_a_plain_transformers_model(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    backend = _backend(tiny_model, tmp_path)
    _step(backend, 1)
    loaded = AutoModelForCausalLM.from_pretrained(backend.save_state("final"),
                                                  dtype=torch.float32)
    ids = torch.tensor([backend.tokenizer("what is 2 + 2?")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits,
                                   backend.model.base(input_ids=ids).logits, atol=1e-6, rtol=0)


def test_the_kl_reference_is_a_frozen_copy_of_the_base(tiny_model, tmp_path):
    backend = _backend(tiny_model, tmp_path, keep_reference=True)
    base = _backend(tiny_model, tmp_path / "base")  # the weights as loaded, never trained
    datums = _datums(backend)
    assert backend.reference_logprobs(datums) == backend.logprobs(datums)
    for seed in (2, 3):
        _step(backend, seed)
    assert _max_diff(backend.logprobs(datums), backend.reference_logprobs(datums)) > 1e-3
    assert _max_diff(backend.reference_logprobs(datums), base.logprobs(datums)) < 1e-6
    with pytest.raises(BackendError, match="kl_coef > 0"):
        base.reference_logprobs(datums)


def test_snapshots_and_adapters_are_lora_only(tiny_model, tmp_path):
    from retrain.backends.local.backend import LocalBackend

    with pytest.raises(BackendError, match="LoRA"):
        _backend(tiny_model, tmp_path).snapshot()
    model = LocalModel.load(tiny_model, "float32", "cpu", 1)
    LocalBackend.new_adapter(model, "extra", lora_rank=4)
    with pytest.raises(BackendError, match="without LoRA adapters"):
        FullBackend(model)


# ---------------------------------------------------------------------------- a run

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model):
    """4 full fine-tuning steps of the tiny model, eval every 2 steps, every checkpoint kept."""
    folder = tmp_path_factory.mktemp("full-run")
    path = write_config(folder, model=FULL, data={"eval_size": 4},
                        training={"max_steps": 4, "eval_every": 2, "save_every": 1},
                        logging={"log_dir": str(folder / "logs")})
    assert run_app(["run", str(path)]) == 0
    return folder / "logs" / "run"


def test_a_full_run_trains_every_weight(run_dir, tiny_model):
    from safetensors.torch import load_file

    losses = [r["loss"] for r in rows(run_dir)]
    assert len(losses) == 4 and len(set(losses)) > 1
    base = load_file(str(Path(tiny_model) / "model.safetensors"))
    final = run_dir / "checkpoints" / "step-000004"
    trained = load_file(str(final / "model.safetensors"))
    assert not (final / "adapter_config.json").exists()
    assert set(trained) == set(base)
    assert [k for k in base if torch.equal(base[k], trained[k])] == []


def test_eval_and_sample_use_the_whole_model(run_dir, capsys):
    from retrain.results.evaluate import EvalRequest, evaluate

    logged = {r["step"]: r["eval_accuracy"] for r in rows(run_dir) if "eval_accuracy" in r}
    for step in (2, 4):
        assert evaluate(run_dir, EvalRequest(step=step)).accuracy.value == logged[step]
    assert run_app(["sample", str(run_dir), "What is 3 + 4?", "--max-tokens", "4"]) == 0
    assert "Traceback" not in capsys.readouterr().err


LOAD_AND_GENERATE = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, out = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
tokenizer = AutoTokenizer.from_pretrained(folder)
ids = tokenizer("What is 3 + 4?", return_tensors="pt")["input_ids"]
with torch.no_grad():
    logits = model(input_ids=ids).logits[0]
    more = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1]:]
json.dump({"ids": ids[0].tolist(), "logits": logits.tolist(), "generated": more.tolist()},
          open(out, "w"))
"""


def test_export_loads_in_plain_transformers_in_a_fresh_process(run_dir, tmp_path, cli_env,
                                                               capsys, tiny_model):
    out = tmp_path / "export"
    step4 = run_dir / "checkpoints" / "step-000004"
    for folder, merged in ((out, []), (tmp_path / "merged", ["--merged"])):  # the same model
        assert run_app(["export", str(run_dir), str(folder), "--step", "4", *merged]) == 0
        assert "fully fine-tuned model of step 4" in capsys.readouterr().out
        assert (folder / "model.safetensors").read_bytes() == \
            (step4 / "model.safetensors").read_bytes()
        assert not (folder / "optimizer.pt").exists()
    card = (out / "README.md").read_text()
    assert "library_name: transformers" in card and "full fine-tuning" in card
    env = {k: v for k, v in cli_env.items() if k != "PYTHONPATH"}  # no retrain on the path
    result = tmp_path / "fresh.json"
    done = subprocess.run([sys.executable, "-c", LOAD_AND_GENERATE, str(out), str(result)],
                          env=env, cwd=tmp_path, text=True, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    got = json.loads(result.read_text())
    assert len(got["generated"]) >= 1
    trainer = _backend(tiny_model, run_dir / "checkpoints")
    trainer.load_state(str(step4))  # the weights as the trainer resumes them
    with torch.no_grad():
        want = trainer.model.base(input_ids=torch.tensor([got["ids"]])).logits[0]
    torch.testing.assert_close(torch.tensor(got["logits"]), want, atol=1e-5, rtol=0)


def test_serve_refuses_a_full_run_as_an_adapter(run_dir):
    from retrain.serve.openai.adapters import find_runs, parse_spec

    with pytest.raises(UserError, match="finetune = 'full'.*retrain serve --model OUT"):
        find_runs([parse_spec(f"x={run_dir}")])


def test_kill_and_resume_repeats_the_uninterrupted_full_run(tmp_path, monkeypatch, cli_env,
                                                            python, tiny_model):
    from safetensors.torch import load_file

    from retrain.config.loader import load_config
    from retrain.run.single import run_single
    from tests.run.test_resume import COMPARED

    monkeypatch.chdir(tmp_path)
    steps = {"max_steps": 6, "batch_size": 2, "group_size": 4, "max_tokens": 12}
    path = write_config(tmp_path, model=FULL, training=steps, data={"eval_size": 0})
    assert run_single(load_config(path, {"logging.log_dir": "straight"}), path) == 0
    straight = rows(tmp_path / "straight" / "run")
    resumed = kill_after_step_3_and_resume(path, cli_env, python, calls=3 * 2 * 4)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    same_rows(straight, resumed, COMPARED)
    final = "run/checkpoints/step-000006/model.safetensors"
    a, b = (load_file(str(tmp_path / d / final)) for d in ("straight", "killed"))
    assert a.keys() == b.keys()
    for k in a:  # float32's default tolerances: the same weights, rounded alike or not
        torch.testing.assert_close(b[k], a[k])


def test_kl_is_zero_at_step_one_and_grows_without_an_adapter(tmp_path, monkeypatch, tiny_model):
    from retrain.config.loader import load_config
    from retrain.run.single import run_single

    monkeypatch.chdir(tmp_path)
    path = write_config(tmp_path, model=FULL, algorithm={"kl_coef": 0.05, "kl_estimator": "k3"},
                        training={"max_steps": 4, "lr": 1e-2}, data={"eval_size": 0})
    assert run_single(load_config(path, {}), path) == 0
    kl = [r["kl"] for r in rows(tmp_path / "logs" / "run")]
    assert abs(kl[0]) < 1e-5  # the sampler's and the trainer's rounding only
    assert kl[-1] > 1e-3 and kl[-1] > 100 * abs(kl[0])

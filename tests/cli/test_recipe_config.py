"""The recipe keys (updates per batch, lr schedule, KL, refill, overlong shaping, finetune):
bounds and did-you-mean, and combinations refused by `explain` and by the run with one line
naming the keys."""

from __future__ import annotations

import pytest

from retrain.cli.app import run_app

BAD = [
    ("[training]\nepochs = 0\n", ["training.epochs", "must be >= 1"]),
    ("[training]\nepochs = 5000\n", ["training.epochs", "must be <= 1024"]),
    ("[training]\nmini_batchs = 2\n", ["did you mean 'training.mini_batches'"]),
    ("[training]\nmini_batches = 4\nbatch_size = 2\n",
     ["training.mini_batches", "training.batch_size", "whole groups"]),
    ("[training]\nlr_schedule = 'cosin'\n", ["training.lr_schedule", "did you mean 'cosine'"]),
    ("[training]\nwarmup_steps = -1\n", ["training.warmup_steps", "must be >= 0"]),
    ("[training]\nmin_lr_ratio = 1.5\nlr_schedule = 'linear'\n",
     ["training.min_lr_ratio", "must be <= 1"]),
    ("[training]\nmin_lr_ratio = 0.1\n", ["training.min_lr_ratio", "training.lr_schedule"]),
    ("[algorithm]\nkl_coef = -1\n", ["algorithm.kl_coef", "must be >= 0"]),
    ("[algorithm]\nkl_estimator = 'k2'\nkl_coef = 0.1\n",
     ["algorithm.kl_estimator", 'use one of "k1", "k3"']),
    ("[algorithm]\nkl_coeff = 0.1\n", ["did you mean 'algorithm.kl_coef'"]),
    ("[algorithm]\nkl_in = 'loss'\n", ["algorithm.kl_in", "algorithm.kl_coef"]),
    ("[algorithm]\nkl_estimator = 'k3'\n", ["algorithm.kl_estimator", "algorithm.kl_coef"]),
    ("[algorithm]\nkl_coef = 0.1\nkl_in = 'loss'\n[backend]\nbackend = 'tinker'\n",
     ["algorithm.kl_in", "backend = 'local'"]),
    ("[training]\nrefil = true\n", ["did you mean 'training.refill'"]),
    ("[training]\nmax_refill_rounds = 0\nrefill = true\n",
     ["training.max_refill_rounds", "must be >= 1"]),
    ("[training]\nmax_refill_rounds = 8\n", ["training.max_refill_rounds", "training.refill"]),
    ("[reward]\noverlong_buffer = -4\n", ["reward.overlong_buffer", "must be >= 0"]),
    ("[reward]\noverlong_bufer = 4\n", ["did you mean 'reward.overlong_buffer'"]),
    ("[reward]\noverlong_penalty = 2.0\n", ["reward.overlong_penalty", "reward.overlong_buffer"]),
    ("[reward]\noverlong_buffer = 64\n[training]\nmax_tokens = 32\n",
     ["reward.overlong_buffer", "training.max_tokens"]),
    ("[reward]\noverlong_buffer = 4\n[environment]\ntools = ['calculator']\n",
     ["reward.overlong_buffer", "environment.tools"]),
    ("[reward]\noverlong_buffer = 4\n[environment]\nkind = 'guess_number'\n",
     ["reward.type", "[reward] scores the task kind"]),
    ("[model]\nfinetune = 'ful'\n", ["model.finetune", "did you mean 'full'"]),
    ("[model]\nfine_tune = 'full'\n", ["did you mean 'model.finetune'"]),
    ("[model]\nfinetune = 'full'\n[backend]\nsampler = 'fast'\n",
     ["backend.sampler", "model.finetune = 'full'", "sampler = 'exact'"]),
    ("[model]\nfinetune = 'full'\n[backend]\nbackend = 'tinker'\n",
     ["model.finetune", "backend = 'local'", "Tinker trains LoRA"]),
]


def _explain(tmp_path, capsys, text: str) -> tuple[int, str]:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    code = run_app(["explain", str(path)])
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("text,fragments", BAD, ids=[f"bad{i:02d}" for i in range(len(BAD))])
def test_explain_refuses_with_one_line_naming_the_keys(tmp_path, capsys, monkeypatch, text,
                                                       fragments):
    monkeypatch.chdir(tmp_path)
    code, out = _explain(tmp_path, capsys, text)
    assert code == 2 and "Traceback" not in out, out
    for fragment in fragments:
        assert fragment in out, f"{fragment!r} not in {out!r}"


@pytest.mark.parametrize("text,fragments", [BAD[3], BAD[7], BAD[12], BAD[-7], BAD[-1]])
def test_the_run_refuses_the_same_combinations(tmp_path, capsys, monkeypatch, text, fragments):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "bad.toml"
    path.write_text(text)
    code = run_app(["run", str(path)])
    out = capsys.readouterr()
    assert code == 2, out
    assert not (tmp_path / "logs").exists()  # nothing started
    for fragment in fragments:
        assert fragment in out.err

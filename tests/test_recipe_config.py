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


@pytest.mark.parametrize("text,fragments", BAD[3:4] + BAD[-1:])
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

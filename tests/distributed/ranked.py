"""What the 2-rank run tests share: the run, and what "equal to one process" means."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.run_helpers import rows

STEPS = 5
# batch_size 3 on 2 ranks: 2 groups on rank 0 and 1 on rank 1 (uneven splits work)
TRAINING = {"max_steps": STEPS, "batch_size": 3, "save_every": 1}
# Times, memory and where the run ran are the process's; the rest must be the same.
OWN = ("time", "_s", "rss", "load_average", "tokens_per_second", "world_size", "cpu_threads",
       "others_busy_cores")


# What the completions decide: equal to the bit. The rest (losses, gradient norms, log-prob
# gaps) is float32 arithmetic over other batch shapes and summation orders: equal to its
# rounding, which a few AdamW steps carry to ~1e-6 relative (seen: 1.6e-6 on a grad norm).
SAMPLED = ("mean_reward", "reward_std", "correct_rate", "num_completions", "sampled_tokens",
           "prefill_tokens", "trained_tokens", "mean_completion_tokens", "max_token_hit_rate",
           "trained_completions", "reward_uniform_group_rate", "batch_size", "lr",
           "eval_accuracy", "initial_eval_accuracy")


def _same_row(want: dict, got: dict) -> None:
    keys = _science(want)
    assert {k: got[k] for k in SAMPLED if k in want} == {k: want[k] for k in SAMPLED
                                                          if k in want}, want["step"]
    assert {k: got[k] for k in keys} == pytest.approx({k: want[k] for k in keys}, rel=1e-4,
                                                       abs=1e-5), want["step"]


def _science(row: dict) -> tuple[str, ...]:
    return tuple(k for k, v in row.items() if isinstance(v, (int, float)) and not any(
        o in k for o in OWN))


TWO_RANKS = {"nproc_per_node": 2}


def torchrun(python: str, *args: str) -> list[str]:
    return [python, "-m", "torch.distributed.run", *args, "-m", "retrain", "run.toml"]


def same_run(reference: Path, run_dir: Path, steps: int = STEPS) -> None:
    want, got = rows(reference)[:steps], rows(run_dir)
    assert len(got) == len(want)
    for a, b in zip(want, got, strict=True):
        _same_row(a, b)
    assert [r["world_size"] for r in got] == [2] * len(got)
    assert [r["world_size"] for r in want] == [1] * len(want)
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(p.name for p in reference.iterdir())
    _same_adapter(reference / "checkpoints" / f"step-{steps:06d}",
                  run_dir / "checkpoints" / f"step-{steps:06d}")


def _same_adapter(a: Path, b: Path) -> None:
    import torch
    from safetensors.torch import load_file

    want, got = (load_file(p / "adapter_model.safetensors") for p in (a, b))
    assert want.keys() == got.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-4, atol=1e-5, msg=name)



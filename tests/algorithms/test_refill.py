"""Dynamic sampling with refill: the policy (pure), and runs on the tiny model where most
groups are uniform: every step trains batch_size groups, and a SIGKILL and resume repeat the
uninterrupted run."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from retrain.algorithms.advantages import compute_advantages
from retrain.algorithms.refill import kept_advantages, signal, to_draw

groups = st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=1, max_size=4),
                  max_size=6)


@given(groups, st.sampled_from(["grpo", "dr_grpo", "rloo", "reinforce_pp"]),
       st.sampled_from(["group", "batch", "none"]))
def test_kept_groups_get_the_advantages_of_a_batch_of_them_alone(rewards, method, scale):
    keep = signal(rewards, [False] * len(rewards))
    got = kept_advantages(rewards, keep, method, scale)
    alone = compute_advantages([g for g, k in zip(rewards, keep, strict=True) if k], method,
                               scale)
    assert [g for g, k in zip(got, keep, strict=True) if k] == alone
    assert all(a == 0.0 for g, k in zip(got, keep, strict=True) if not k for a in g)


def test_signal_and_how_many_to_draw():
    assert signal([[1, 1], [0, 1], [0, 1], [2]], [False, False, True, False]) == \
        [False, True, False, False]
    assert to_draw(1, 4, 0, 2) == 3 and to_draw(4, 4, 0, 2) == 0 and to_draw(1, 4, 2, 2) == 0


# ---------------------------------------------------------------------------- runs

SPARSE = '''

def sparse(completion, answer):
    """A reward that varies for a third of the problems, 0 for the rest (uniform groups)."""
    reward(completion, answer)  # counts the call (the kill below)
    return len(completion) % 4 / 3 if int(answer) % 3 == 0 else 0.0
'''
COMPARED = ("mean_reward", "loss", "grad_norm", "num_completions", "prompts_drawn",
            "refill_rounds", "trained_groups", "sampler_trainer_logprob_diff", "lr")


def _config(folder):
    from tests.run_helpers import DIGITS_REWARD, write_config

    path = write_config(folder, reward={"type": "custom", "function": "sparse.py:sparse",
                                        "timeout_s": 600.0},
                        training={"max_steps": 5, "batch_size": 2, "group_size": 4,
                                  "max_tokens": 8, "refill": True, "max_refill_rounds": 10},
                        data={"eval_size": 4})
    (folder / "sparse.py").write_text(DIGITS_REWARD + SPARSE)
    return path


def test_refill_trains_full_batches_and_resumes_exactly(tmp_path, monkeypatch, cli_env, python,
                                                        tiny_model):
    pytest.importorskip("torch")
    from retrain.config.loader import load_config
    from retrain.run.single import run_single
    from tests.run_helpers import kill_after_step_3_and_resume, rows, same_rows, state

    monkeypatch.chdir(tmp_path)
    path = _config(tmp_path)
    assert run_single(load_config(path, {"logging.log_dir": "straight"}), path) == 0
    straight = rows(tmp_path / "straight" / "run")
    assert all(r["trained_groups"] == 2 for r in straight)
    assert any(r["refill_rounds"] > 0 for r in straight)
    for r in straight:
        assert r["num_completions"] == r["prompts_drawn"] * 4 > r["trained_groups"]
    final = state(tmp_path / "straight" / "run")["data_cursor"]
    assert final["position"] + final["epoch"] * final["n_items"] == \
        sum(r["prompts_drawn"] for r in straight)  # the cursor moved by every prompt drawn

    # kill in step 4's first reward call, after exactly the calls of the first eval and steps 1-3
    calls = 4 + sum(r["num_completions"] for r in straight[:3])
    resumed = kill_after_step_3_and_resume(path, cli_env, python, calls)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    same_rows(straight, resumed, COMPARED)
    assert resumed[-1]["eval_accuracy"] == straight[-1]["eval_accuracy"]

"""Off-policy overlap (`training.max_steps_off_policy = 1`) against `retrain serve` on
127.0.0.1: the sampler a batch starts on is the one it finishes on, the real CLI logs how
stale each step's samples were, and a run killed mid-step resumes with the batch that was
sampled ahead (no step lost, none repeated, the same numbers as an uninterrupted run).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import numpy as np
import pytest

pytest.importorskip("tinker")

from retrain.backends.base import AdamParams, LossConfig, SamplingParams, make_datum  # noqa: E402
from retrain.backends.tinker.backend import TinkerBackend  # noqa: E402
from tests import warm  # noqa: E402
from tests.run_helpers import (  # noqa: E402
    rows,
    run_in_process,
    same_rows,
    state,
    wait_for,
    write_config,
)
from tests.serve_doubles import BigramEngine, Served  # noqa: E402

EOS = 2
COMPARED = ("batch_size", "num_completions", "mean_reward", "reward_std", "loss",
            "mean_completion_tokens", "max_token_hit_rate", "sample_staleness")


def _tinker_config(folder, url, *, steps=6, off_policy=1):
    return write_config(
        folder, training={"max_steps": steps, "batch_size": 2, "group_size": 4,
                          "max_tokens": 8, "save_every": 0, "max_steps_off_policy": off_policy},
        data={"eval_size": 0}, model={"name": "tiny-random", "lora_rank": 8},
        backend={"backend": "tinker", "base_url": url, "request_timeout_s": 60.0})


def test_sample_async_keeps_the_weights_it_started_on(tmp_path, sdk_env, tiny_model):
    """A batch submitted before an update comes from the old weights, even though the
    update (and the sampler refresh) happens while its requests are still in flight."""
    engine = BigramEngine(vocab=260, eos=EOS, tokenizer_id=tiny_model, delay_s=0.3)
    prompts = [[1, 70, 71], [1, 72]]
    params = SamplingParams(max_tokens=6, seed=11)
    with Served(engine, tmp_path, hold_s=2.0) as served:
        a = TinkerBackend(base_model="bigram-test", lora_rank=4, seed=5, base_url=served.url,
                          request_timeout_s=30)
        twin = TinkerBackend(base_model="bigram-test", lora_rank=4, seed=5,
                             base_url=served.url, request_timeout_s=30)
        before = twin.sample(prompts, 4, params)        # what the untrained weights give
        comps = a.sample([prompts[0]], 8, SamplingParams(max_tokens=6, seed=1))[0]
        job = a.sample_async(prompts, 4, params)
        datums = [make_datum(prompts[0], c, 1.0 if i % 2 else -1.0)
                  for i, c in enumerate(comps)]
        a.forward_backward(datums, LossConfig())
        a.optim_step(AdamParams(learning_rate=0.5))  # refreshes a's sampler meanwhile
        got = job.result()
        after = a.sample(prompts, 4, params)
        for g_got, g_before in zip(got, before, strict=True):
            for c_got, c_before in zip(g_got, g_before, strict=True):
                assert c_got.tokens == c_before.tokens
                np.testing.assert_allclose(c_got.logprobs, c_before.logprobs, atol=1e-6)
        flat = lambda gs: [lp for g in gs for c in g for lp in c.logprobs]  # noqa: E731
        assert not np.allclose(flat(after)[:5], flat(before)[:5])  # the update did change them
        a.close()
        twin.close()


def test_local_backend_refuses_off_policy(tmp_path, cli_env, python):
    path = write_config(tmp_path, training={"max_steps_off_policy": 1})
    proc = warm.run([python, "-m", "retrain", "run", str(path)], env=cli_env,
                    capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2
    assert "training.max_steps_off_policy" in proc.stderr and "tinker" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_overlapped_run_logs_staleness_and_resumes_exactly(tiny_server, tmp_path, tinker_cli_env,
                                                           sdk_env, python):
    """6 steps straight == SIGKILL in step 5, resume. With overlap, step 4's checkpoint lands
    during step 5's update, so the kill (while step 5 scores) finds state.json at step 3 and
    step 4's row written: the resume drops that row and trains step 4 again on the batch
    saved with checkpoint 3, exactly as the straight run did."""
    path = _tinker_config(tmp_path, tiny_server.url)
    base = [python, "-m", "retrain", "run", str(path)]
    done = run_in_process([*base[3:], "--log-dir", "straight"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    straight = rows(tmp_path / "straight" / "run")
    assert [r["step"] for r in straight] == [1, 2, 3, 4, 5, 6]
    # step 1 samples on-policy; a later step's samples are one update old, unless the step
    # before had nothing to learn from (every group uniform: no update was made)
    updated = [r["trained_completions"] > 0 for r in straight]
    assert [r["sample_staleness"] for r in straight] == [0] + [int(u) for u in updated[:-1]]
    assert sum(updated[:-1]) >= 2
    stale = [r["sampler_trainer_logprob_diff"] for r in straight
             if r["sample_staleness"] == 1 and r["trained_completions"]]
    assert stale and all(d > 1e-4 for d in stale), stale  # really off-policy

    counter = tmp_path / "calls"
    killed_env = dict(tinker_cli_env, RETRAIN_TEST_COUNTER=str(counter),
                      RETRAIN_TEST_BLOCK_AFTER=str(4 * 2 * 4))  # blocks scoring step 5
    cmd = [*base, "--log-dir", "killed"]
    proc = warm.Popen(cmd, env=killed_env, stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    run_dir = tmp_path / "killed" / "run"
    try:
        wait_for(lambda: counter.exists() and int(counter.read_text() or 0) > 32, proc)
        s = state(run_dir)
        assert s["step"] == 3 and s["status"] == "running"  # checkpoint 4 not landed yet
        assert [r["step"] for r in rows(run_dir)] == [1, 2, 3, 4]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    saved = json.loads((run_dir / s["extra"]["prefetched_batch"]).read_text())
    assert saved["step"] == 4 and saved["staleness"] == straight[3]["sample_staleness"]
    assert s["data_cursor"] == saved["cursor_before"]  # state.json: committed steps only

    resumed_proc = run_in_process(cmd[3:], tmp_path)  # the resume: in this process
    assert resumed_proc.returncode == 0, resumed_proc.stderr[-3000:]
    assert "after step 3 (dropped 1 metrics rows written after it)" in resumed_proc.stdout
    resumed = rows(run_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    lengths = [len(c["tokens"]) for g in saved["groups"] for c in g]
    assert resumed[3]["mean_completion_tokens"] == pytest.approx(sum(lengths) / len(lengths))
    # The loss is -mean(ratio x advantage) with advantages that sum to 0 in each group and
    # ratios near 1: a cancellation whose value (~1e-8) is float32 rounding of terms of order 1,
    # which a resumed process may round differently (seen: 3.3e-8 vs 6.8e-8). abs=1e-6 is
    # float32's resolution at that scale; tokens, rewards and staleness still match to 1e-6.
    same_rows(straight, resumed, COMPARED)
    assert state(run_dir)["status"] == "completed"
    assert len(list((run_dir / "prefetch").glob("*.json"))) <= 2

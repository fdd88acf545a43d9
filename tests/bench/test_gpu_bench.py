"""bench/gpu/main.py is the one command a GPU machine runs: `--smoke` runs the same code on the
CPU with tiny shapes, so the script cannot rot between GPU sessions."""

from __future__ import annotations

import json
import subprocess

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")


def test_the_smoke_run_fills_every_part_of_the_report(tmp_path, capsys):
    """In this process (the command line's own process is the next test's): the smoke run
    sets one torch thread and the global seed, which are put back after."""
    import torch

    from bench.gpu.main import main

    threads, rng = torch.get_num_threads(), torch.random.get_rng_state()
    out = tmp_path / "gpu.json"
    try:
        code = main(["--smoke", "--profile", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)
    printed = capsys.readouterr()
    assert code == 0, printed.err[-2000:]
    assert "| tiny | 8 |" in printed.out and "exact / fast" in printed.out
    report = json.loads(out.read_text())
    tiny = report["models"]["tiny"]
    assert [d["batch"] for d in tiny["decode"]] == [4, 8]
    assert all(d["eager_tok_s"] > 0 and d["fast_tok_s"] > 0 for d in tiny["decode"])
    assert tiny["exact"]["same_completions"] == 1.0  # float32: same draws, same tokens
    assert tiny["exact"]["logprob_gap_max"] < 1e-5
    assert 0 <= tiny["fast"]["mismatch_kl"] < 1e-6 and tiny["fast"]["logprob_gap_max"] < 1e-4
    step = tiny["rl_step"]
    assert step["completions"] == 4 and step["sample_s"] > 0 and step["peak_gib"] is None
    assert tiny["graph_after_adamw"] == {"skipped": "no CUDA: graphs capture only there"}
    assert report["machine"]["device"] == "cpu"
    assert tiny["decode"][1]["one_step_tok_s"] > 0  # today's loop, on the first model
    qwen3 = report["models"]["tiny-qwen3"]  # q/k norms, head_dim 32 != 64 / 4
    assert qwen3["exact"]["same_completions"] == 1.0 and qwen3["fast"]["mismatch_kl"] < 1e-6
    for r in (tiny, qwen3):  # nano-vllm's recipe: every row to its own output length
        nano = r["nano_vllm_recipe"]
        assert nano["all_tokens"] and nano["sequences"] == 4 and nano["tok_s"] > 0
        assert "aten::mm" in r["profile"]["table"] and "CPU" in r["profile"]["summary"]
    assert "| nano-vllm recipe |" in printed.out and "profile of tiny-qwen3" in printed.out
    for r in (tiny, qwen3):  # the trainer (bench/gpu/training.py), each layout, LoRA and full
        t = r["training"]
        assert set(t["lora"]) == set(t["full"]) == {"packed", "prefix"}, t
        for row in (*t["lora"].values(), *t["full"].values()):
            assert row["positions_s"] > 0 and row["mfu"] > 0 and row["micro_batches"] == 1
    assert report["matmul"]["tflops"] > 0 and "| tiny | full | packed |" in printed.out
    side = report["side_by_side"]  # the real trainer's steps beside TRL's (or why not)
    assert len(side["retrain"]["steps"]) == 1 and side["retrain"]["train_s"] > 0
    assert "skipped" in side["trl"] or side["trl"]["train_s"] > 0


def test_without_cuda_the_full_run_says_so(cli_env, python):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the full run would start")
    proc = subprocess.run([python, "-m", "bench.gpu"], env=cli_env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr


def test_the_profiles_timeline_counts_busy_and_idle_device_time():
    """Kernels [0, 10], [5, 20] (overlapping), [50, 60], [100, 130] us over 2 steps: busy 20 +
    10 + 30 = 60 us, idle 30 + 40 = 70 us; host operators are not device time."""
    from types import SimpleNamespace

    import torch

    from bench.gpu.profile import device_timeline

    def event(start, end, name, kind=torch.autograd.DeviceType.CUDA):
        return SimpleNamespace(device_type=kind, name=name,
                               time_range=SimpleNamespace(start=start, end=end))

    events = [event(50, 60, "c"), event(0, 10, "a"), event(5, 20, "b"), event(100, 130, "d"),
              event(0, 500, "aten::mm", torch.autograd.DeviceType.CPU)]
    got = device_timeline(events, steps=2)
    assert got["kernels"] == 4 and got["span_ms"] == pytest.approx(0.065)
    assert got["busy_ms"] == pytest.approx(0.030) and got["idle_ms"] == pytest.approx(0.035)
    assert got["gaps_over_50us"] == 0
    assert got["largest_gaps"] == ["40 us after c before d", "30 us after b before c"]
    assert device_timeline(events[-1:], steps=2) is None


def test_the_command_keeps_to_its_time_budget(monkeypatch):
    """330 s by default: the side-by-side keeps a quarter, each model an equal part of the
    rest; shares handed out later shrink with the time already spent; a tool gets 30 s at
    least."""
    from bench.gpu import main as gpu

    now = [1000.0]
    monkeypatch.setattr(gpu.time, "perf_counter", lambda: now[0])
    deadline = gpu.Deadline(330.0)
    sampling, training = deadline.model_shares(3)
    each = (330.0 - 0.25 * 330.0) / 3
    assert sampling == pytest.approx(0.55 * each) and training == pytest.approx(0.30 * each)
    now[0] += 200.0  # the first model took 200 s of the 247.5 the models share
    sampling, training = deadline.model_shares(2)
    assert sampling == pytest.approx(0.55 * 47.5 / 2)
    now[0] += 100.0
    assert deadline.model_shares(1) == (0.0, 0.0)  # late: the next measurements skip
    assert deadline.per_tool() == 30.0
    assert gpu.Deadline(330.0).per_tool() == pytest.approx(165.0)

"""Back-pressure on real tiny runs: gradient diagnostics, learning-rate scaling, live roofline."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

pytest.importorskip("torch")

from retrain.config.loader import load_config  # noqa: E402
from retrain.config.sections import BackpressureConfig  # noqa: E402
from retrain.control.backpressure.controller import BackpressureController  # noqa: E402
from retrain.control.roofline import roofline  # noqa: E402
from retrain.control.usl import usl_throughput  # noqa: E402
from retrain.run.single import run_single  # noqa: E402
from tests.run_helpers import BASE, rows, state, write_config  # noqa: E402


@pytest.fixture
def workdir(tmp_path, monkeypatch, tiny_model):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run(path):
    return run_single(load_config(path), path, new=False)


def test_gradient_diagnostics_per_micro_batch_and_null_with_one(workdir):
    several = write_config(workdir, "several", data={"eval_size": 0},
                           training={"max_steps": 3, "micro_batch_size": 1})
    one = write_config(workdir, "one", data={"eval_size": 0}, training={"max_steps": 2})
    assert run(several) == 0 and run(one) == 0
    for r in rows(workdir / "logs" / "several"):
        if r["trained_completions"] >= 2:
            assert -1.0 <= r["grad_coherence"] <= 1.0
        assert r["grad_noise_scale"] is None or r["grad_noise_scale"] > 0
    assert any(r["grad_coherence"] is not None for r in rows(workdir / "logs" / "several"))
    for r in rows(workdir / "logs" / "one"):                   # a single micro-batch: null
        assert r["grad_noise_scale"] is None and r["grad_coherence"] is None
    assert "grad_noise" in state(workdir / "logs" / "several")["extra"]


@pytest.mark.parametrize("scaling", ["none", "sqrt", "linear"])
def test_the_applied_learning_rate_follows_the_batch(workdir, scaling):
    bp = {"enabled": True, "warmup_steps": 3, "max_batch_size": 4, "lr_scaling": scaling}
    path = write_config(workdir, backpressure=bp, data={"eval_size": 0},
                        training={"max_steps": 4, "batch_size": 2, "lr": 1e-2})
    assert run(path) == 0
    got = rows(workdir / "logs" / "run")
    assert len({r["batch_size"] for r in got}) > 1          # the warm-up sweep moved it
    power = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}[scaling]
    for r in got:
        assert r["lr"] == pytest.approx(1e-2 * (r["batch_size"] / 2) ** power)


@dataclass(frozen=True)
class Observed:
    """What the run handed its controller for one step."""

    batch_size: int
    tokens: float
    flops: float | None
    bytes_moved: float | None


def observed_run(workdir, monkeypatch, bp: dict, steps: int) -> list[Observed]:
    """A real tiny run with back-pressure on; returns what each step handed the controller
    (the real controller still decides: this only listens)."""
    seen, observe = [], BackpressureController.observe

    def listening(self, batch_size, tokens, step_time_s, **kw):
        if not kw.get("oom"):
            seen.append(Observed(batch_size, tokens, kw.get("flops"), kw.get("bytes_moved")))
        return observe(self, batch_size, tokens, step_time_s, **kw)

    monkeypatch.setattr(BackpressureController, "observe", listening)
    path = write_config(workdir, backpressure=bp, data={"eval_size": 0},
                        training={"max_steps": steps})
    assert run(path) == 0
    assert len(seen) == steps
    return seen


# A USL machine whose p* (22) lies above the run's concurrencies (4 to 16)
MACHINE = (0.02, 2e-3, 500.0)


def replayed_regimes(seen: list[Observed], bp: dict) -> list[str]:
    """The run's own FLOP and byte estimates fed to a fresh controller with the step times of
    a noiseless USL machine: the live run's times are too noisy on a busy 2-core machine for
    its fit to leave the warm-up within a test's steps (CI, 2026-11-28: 14 steps at load 4.6,
    all warm-up). A size the run did not step is scaled from the nearest one it did."""
    by_size = {o.batch_size: o for o in seen}
    group_size = BASE["training"]["group_size"]    # write_config's
    ctl = BackpressureController(BackpressureConfig(**bp), group_size)
    b, regimes = ctl.first_batch_size(2), []
    for _ in range(40):
        ref = by_size[min(by_size, key=lambda k: abs(k - b))]   # b itself if stepped
        f = b / ref.batch_size
        tokens = ref.tokens * f
        d = ctl.observe(b, tokens, tokens / usl_throughput(b * group_size, *MACHINE),
                        flops=ref.flops * f, bytes_moved=ref.bytes_moved * f)
        regimes.append(d.regime)
        b = d.batch_size
    return [r for r in regimes if r != "warmup"]


def assert_estimates_say(seen: list[Observed], bp: dict, expected: str) -> None:
    """Every step's estimates reached the controller, and with the configured peaks the
    roofline puts each on the expected side of the machine balance."""
    for o in seen:
        assert o.flops > 0 and o.bytes_moved > 0, o
        roof = roofline(o.flops, o.bytes_moved, 1.0, bp["peak_gflops"], bp["peak_bw_gb_s"])
        assert roof.regime == expected, (o, roof)


def test_low_peaks_make_a_real_run_compute_bound(workdir, monkeypatch):
    """FLOPs and bytes estimates reach the controller: with a tiny peak FLOP/s and a huge
    bandwidth the machine balance is far below any step's intensity."""
    bp = {"enabled": True, "warmup_steps": 3, "max_batch_size": 4, "peak_gflops": 0.001,
          "peak_bw_gb_s": 1000.0}
    seen = observed_run(workdir, monkeypatch, bp, steps=8)   # 8: work.MIN_STEPS
    assert_estimates_say(seen, bp, "compute_bound")
    fitted = replayed_regimes(seen, bp)
    assert fitted and set(fitted) == {"compute_bound"}, fitted
    # The step's work reaches the controller too (throughput counted in work, control/work.py)
    got = rows(workdir / "logs" / "run")
    work = state(workdir / "logs" / "run")["controller"]["work"]
    assert len(work["steps"]) == 8 and work["ref"] is not None
    for r, (p, (prompt, completion, trained, groups, decoded), _) in zip(got, work["steps"],
                                                                          strict=True):
        assert p == r["batch_size"] * r["group_size"]
        assert completion <= decoded and decoded % p == 0   # p x the longest completion
        assert prompt + completion == pytest.approx(r["tokens_per_second"] * r["step_time_s"])
        assert completion == pytest.approx(r["mean_completion_tokens"] * r["num_completions"])
        assert (trained > 0) == (r["trained_completions"] > 0) and groups <= r["batch_size"]
        assert r["bp_step_throughput"] > 0
        assert r["bp_regime"] == "warmup" or math.isfinite(r["bp_throughput"])


def test_high_bandwidth_demand_makes_it_memory_bound(workdir, monkeypatch):
    bp = {"enabled": True, "warmup_steps": 3, "max_batch_size": 4, "peak_gflops": 1e9,
          "peak_bw_gb_s": 1e-3}
    seen = observed_run(workdir, monkeypatch, bp, steps=3)
    assert_estimates_say(seen, bp, "memory_bound")
    fitted = replayed_regimes(seen, bp)
    assert fitted and set(fitted) == {"memory_bound"}, fitted


def test_one_micro_batch_keeps_no_copy_of_the_gradient():
    """Nothing to compare: only the count, as with the copies, and none is made (with full
    fine-tuning each flat copy is as large as the model)."""
    import torch

    from retrain.backends.local.training.diagnostics import GradDiagnostics

    w = torch.nn.Parameter(torch.randn(5))
    diag = GradDiagnostics([w], 3, micro_batches=1)
    (torch.randn(3, 5) @ w).sum().backward()
    diag.after_micro_batch(3)
    assert diag.metrics() == {"grad_micro_batches": 1.0}
    assert diag.start.numel() == 0 and diag.last is None


def test_micro_batch_gradients_are_recovered_from_the_accumulation():
    """Each micro-batch's own token-mean gradient, as if it had been computed alone."""
    import torch

    from retrain.backends.local.training.diagnostics import GradDiagnostics

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5))
    xs = [torch.randn(3, 5), torch.randn(7, 5), torch.randn(2, 5)]
    total = sum(len(x) for x in xs)
    diag = GradDiagnostics([w], total)
    alone = []
    for x in xs:
        (torch.tanh(x @ w).sum() / total).backward()
        diag.after_micro_batch(len(x))
        (g,) = torch.autograd.grad(torch.tanh(x @ w).mean(), [w])
        alone.append(g)
    m = diag.metrics()
    assert m["grad_micro_batches"] == 3 and m["grad_big_tokens"] == total
    assert m["grad_small_sq_norm"] == pytest.approx(sum(float(g @ g) for g in alone) / 3)
    assert m["grad_big_sq_norm"] == pytest.approx(float(w.grad @ w.grad))
    cos = torch.nn.functional.cosine_similarity
    want = (float(cos(alone[0], alone[1], dim=0)) + float(cos(alone[1], alone[2], dim=0))) / 2
    assert m["grad_coherence"] == pytest.approx(want)

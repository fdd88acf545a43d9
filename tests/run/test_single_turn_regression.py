"""Single-turn regression: today's configs give the same datums and rows through the rollout.

tests/data/single_turn_datums.json holds every forward_backward's datums of each case, captured
on main (regenerate only for an intended change:
`PYTHONPATH=. python tests/run/test_single_turn_regression.py`). Each case is one of configs/'s
[data] + [reward] setups on the tiny model; the digits reward gives the groups signal.

Token ids, masks and counts must match exactly. Floats (log-probs, advantages, losses) are
compared within a tolerance, because machines of our kind differ in their last bits: an AVX2-only
CPU rounds float32 matmuls differently from an AVX-512 one, and two Adam steps amplify that where
a gradient is near zero. FLOAT_TOL is an order of magnitude above the largest gap measured
between the two (`ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2` vs default, see
bench/RESULTS.md) and far below any change a real regression makes (a wrong shift or temperature
moves log-probs by 1e-1 or more).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "data" / "single_turn_datums.json"
DIGITS = {"type": "custom", "function": "digits.py:reward", "timeout_s": 600.0}
ROW_KEYS = ("mean_reward", "reward_std", "correct_rate", "num_completions",
            "trained_completions", "max_token_hit_rate", "mean_completion_tokens", "loss",
            "reward_uniform_group_rate", "eval_accuracy", "initial_eval_accuracy")

CASES = {
    "smoke-tiny": {"data": {"source": "arithmetic", "size": 64, "eval_size": 8},
                   "reward": {"type": "match"}},
    "arithmetic-digits": {"data": {"source": "arithmetic", "digits": 2,
                                   "operations": ["+", "-"], "eval_size": 4},
                          "reward": DIGITS, "algorithm": {"advantage": "grpo"}},
    "countdown-digits": {"data": {"source": "countdown", "countdown_numbers": 3,
                                  "eval_size": 4},
                         "reward": DIGITS, "algorithm": {"advantage": "dr_grpo"}},
    "jsonl-format": {"data": {"source": "jsonl", "path": "capitals.jsonl", "eval_size": 4,
                              "instruction": "Answer with the city name inside \\boxed{}."},
                     "reward": {"type": "format", "pattern": "\\d"}},
    "plain-text-digits": {"data": {"source": "arithmetic", "chat_template": False,
                                   "eval_size": 0}, "reward": DIGITS},
}


EXACT = ("input_tokens", "target_tokens", "mask")
FLOATS = ("logprobs", "advantages")
FLOAT_TOL = 1e-4  # absolute, on log-probs, advantages and losses of order 1 (see the docstring)


def _record(datums) -> list[dict]:
    return [{k: list(getattr(d, k)) for k in EXACT + FLOATS} for d in datums]


def capture(name: str, folder: Path) -> dict:
    """Run the case for 3 steps; every forward_backward's datums, and the rows."""
    from retrain.backends.local.backend import LocalBackend
    from retrain.config.loader import load_config
    from retrain.run.single import run_single
    from tests.run_helpers import rows, write_config

    sections = {k: dict(v) for k, v in CASES[name].items()}
    sections.setdefault("training", {}).update(max_steps=3, eval_every=2)
    shutil.copy(REPO / "configs" / "data" / "capitals.jsonl", folder / "capitals.jsonl")
    path = write_config(folder, name=name, **sections)
    calls = []
    real = LocalBackend.forward_backward

    def recording(self, datums, loss):
        calls.append(_record(datums))
        return real(self, datums, loss)

    LocalBackend.forward_backward = recording
    try:
        cwd = os.getcwd()
        os.chdir(folder)
        assert run_single(load_config(path, {}), path) == 0
    finally:
        os.chdir(cwd)
        LocalBackend.forward_backward = real
    got = rows(folder / "logs" / name)
    return {"datums": calls,
            "rows": [{k: r[k] for k in ROW_KEYS if k in r} for r in got]}


def _assert_close(got, want, where: str) -> None:
    """Exact for ints, strings and None; within FLOAT_TOL for floats."""
    if isinstance(want, float) or isinstance(got, float):
        assert got == pytest.approx(want, rel=0, abs=FLOAT_TOL), where
    else:
        assert got == want, where


def _assert_same_datums(got: list, want: list, case: str) -> None:
    assert len(got) == len(want), f"{case}: forward_backward calls"
    for c, (call, call_want) in enumerate(zip(got, want, strict=True)):
        assert len(call) == len(call_want), f"{case}: call {c}: datums"
        for i, (d, d_want) in enumerate(zip(call, call_want, strict=True)):
            for key in EXACT:
                assert d[key] == d_want[key], f"{case}: call {c} datum {i} {key}"
            for key in FLOATS:
                assert d[key] == pytest.approx(d_want[key], rel=0, abs=FLOAT_TOL), \
                    f"{case}: call {c} datum {i} {key}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_single_turn_datums_match_the_fixture(name, tmp_path, tiny_model):
    expected = json.loads(FIXTURE.read_text())[name]
    got = capture(name, tmp_path)
    _assert_same_datums(got["datums"], expected["datums"], name)
    assert [sorted(r) for r in got["rows"]] == [sorted(r) for r in expected["rows"]]
    for step, (row, want) in enumerate(zip(got["rows"], expected["rows"], strict=True), 1):
        for key in want:
            _assert_close(row[key], want[key], f"{name}: step {step} {key}")


if __name__ == "__main__":  # regenerate the fixture (an intended change only)
    import tempfile

    from retrain.backends.models import TINY, resolve_model

    resolve_model(TINY)
    out = {}
    for case in sorted(CASES):
        with tempfile.TemporaryDirectory() as tmp:
            out[case] = capture(case, Path(tmp))
            print(case, len(out[case]["datums"]), "forward_backward calls", file=sys.stderr)
    FIXTURE.write_text(json.dumps(out, sort_keys=True) + "\n")

"""Single-turn regression: today's configs give bit-identical datums through the rollout.

The digests in tests/data/single_turn_datums.json were captured on main before the trainer
went through retrain/environments/rollout.py (regenerate only for an intended change:
`PYTHONPATH=. python tests/test_single_turn_regression.py`). Each case is one of configs/'s
[data] + [reward] setups on the tiny model; the digits reward gives the groups signal.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
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


def _digest_datums(datums) -> str:
    h = hashlib.sha256()
    for d in datums:
        for seq in (d.input_tokens, d.target_tokens):
            h.update(struct.pack(f"<{len(seq)}q", *seq))
        for seq in (d.logprobs, d.advantages, d.mask):
            h.update(struct.pack(f"<{len(seq)}d", *seq))
        h.update(b"|")
    return h.hexdigest()


def capture(name: str, folder: Path) -> dict:
    """Run the case for 3 steps; the digest of every forward_backward's datums and rows."""
    from retrain.backends.local import LocalBackend
    from retrain.config_file import load_config
    from retrain.trainer import run_single
    from tests.run_helpers import rows, write_config

    sections = {k: dict(v) for k, v in CASES[name].items()}
    sections.setdefault("training", {}).update(max_steps=3, eval_every=2)
    shutil.copy(REPO / "configs" / "data" / "capitals.jsonl", folder / "capitals.jsonl")
    path = write_config(folder, name=name, **sections)
    digests = []
    real = LocalBackend.forward_backward

    def recording(self, datums, loss):
        digests.append(_digest_datums(datums))
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
    return {"datums": digests,
            "rows": [{k: r[k] for k in ROW_KEYS if k in r} for r in got]}


@pytest.mark.parametrize("name", sorted(CASES))
def test_single_turn_datums_are_bit_identical(name, tmp_path, tiny_model):
    expected = json.loads(FIXTURE.read_text())[name]
    got = capture(name, tmp_path)
    assert got["datums"] == expected["datums"]
    assert got["rows"] == expected["rows"]


if __name__ == "__main__":  # regenerate the fixture (an intended change only)
    import tempfile

    from retrain.models import TINY, resolve_model

    resolve_model(TINY)
    out = {}
    for case in sorted(CASES):
        with tempfile.TemporaryDirectory() as tmp:
            out[case] = capture(case, Path(tmp))
            print(case, len(out[case]["datums"]), "forward_backward calls", file=sys.stderr)
    FIXTURE.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")

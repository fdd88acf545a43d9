"""bench/distributed.py: its config is a valid retrain file, and its table reads speed-up
and per-rank efficiency from the runs' figures."""

from __future__ import annotations

import argparse

from bench.distributed import config, table
from retrain.config.loader import loads_config


def test_the_benchs_config_is_a_valid_run():
    args = argparse.Namespace(model="tiny-random", dtype="float32", device="cpu", batch=4,
                              group=8, max_tokens=32, warmup=2, steps=8)
    cfg = loads_config(config(args))
    assert (cfg.training.batch_size, cfg.training.max_steps, cfg.model.threads) == (4, 10, 0)


def test_the_table_reads_speedup_and_per_rank_efficiency():
    text = table([{"ranks": 1, "step_s": 2.0, "steps_per_s": 0.5, "trained_tok_s": 1000.0},
                  {"ranks": 2, "step_s": 1.25, "steps_per_s": 0.8, "trained_tok_s": 1600.0}])
    assert "| 2 | 1.250 | 0.80 | 1600 | 1.60x | 80% |" in text

"""`retrain explain`'s [distributed] line: the ranks, the prompt groups each takes of a step,
and the all-reduce bytes (trainable parameters x 4 bytes x updates per step)."""

from __future__ import annotations

import json

from retrain.cli.app import run_app
from retrain.cli.explain import distributed as dist_line
from retrain.cli.explain import memory as mem

MODEL = "[model]\nname = 'tiny-random'\ndevice = 'cpu'\n"


def _settings(tmp_path, capsys, text: str) -> dict:
    path = tmp_path / "d.toml"
    path.write_text(text)
    assert run_app(["explain", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["settings"]


def test_groups_per_rank_even_and_uneven():
    assert dist_line.groups_text(8, 2) == "4"
    assert dist_line.groups_text(5, 2) == "2-3"
    assert dist_line.groups_text(7, 3) == "2-3"
    assert dist_line.allreduce_bytes(1000, 6) == 24_000


def test_the_line_counts_lora_parameters_in_float32_per_update(tiny_model, tmp_path, capsys):
    adapter = mem.read_shapes(mem.model_folder("tiny-random", tiny_model)).lora_count([], 8)
    text = MODEL + ("[training]\nbatch_size = 5\nmini_batches = 2\nepochs = 3\n"
                    "[distributed]\nnproc_per_node = 2\ntimeout_s = 30\n")
    line = _settings(tmp_path, capsys, text)["distributed"]
    assert line.startswith("2 ranks per node, 2-3 prompt groups each of 5 per step; ")
    assert f"all-reduce ~{adapter * 4 * 6 / 1024:.1f} KiB per step ({adapter:,} trainable " \
        "parameters x 4 bytes x 6 updates)" in line
    assert line.endswith("collective timeout 30s")


def test_full_fine_tuning_reduces_every_parameter(tiny_model, tmp_path, capsys):
    n = mem.read_shapes(mem.model_folder("tiny-random", tiny_model)).count()
    text = MODEL + "finetune = 'full'\n[training]\nbatch_size = 4\n[distributed]\n" \
        "nproc_per_node = 4\n"
    line = _settings(tmp_path, capsys, text)["distributed"]
    assert line.startswith("4 ranks per node, 1 prompt group each of 4 per step")
    assert f"({n:,} trainable parameters x 4 bytes x 1 update)" in line
    assert f"~{n * 4 / 1024:.1f} KiB" in line


def test_one_rank_shows_no_line_and_plain_text_shows_it(tiny_model, tmp_path, capsys):
    assert "distributed" not in _settings(tmp_path, capsys, MODEL)
    path = tmp_path / "p.toml"
    path.write_text(MODEL + "[training]\nbatch_size = 4\n[distributed]\nnproc_per_node = 2\n")
    assert run_app(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "distributed    2 ranks per node, 2 prompt groups each of 4 per step" in out


def test_auto_on_a_cpu_is_one_rank(tmp_path, capsys):
    line = _settings(tmp_path, capsys, MODEL + "[distributed]\nnproc_per_node = 'auto'\n")
    assert line["distributed"] == '1 rank (nproc_per_node = "auto": no CUDA device here)'


def test_a_model_not_here_yet_says_so(tmp_path, capsys):
    text = ("[model]\nname = 'nobody/not-cached'\ndevice = 'cpu'\n[training]\nbatch_size = 4\n"
            "[distributed]\nnproc_per_node = 2\n")
    line = _settings(tmp_path, capsys, text)["distributed"]
    assert "all-reduce size unknown until nobody/not-cached is on this machine" in line

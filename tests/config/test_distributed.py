"""[distributed]: its keys, the number of ranks, the settings several ranks cannot run with
(one line each, exit 2, through the real CLI), the GPU count on a cuda device, and that a
resume may change the section."""

from __future__ import annotations

import subprocess
import sys

import pytest

from retrain.cli.app import run_app
from retrain.config import distributed_section as dist
from retrain.config import loader
from retrain.config.distributed_section import DistributedConfig, groups_per_rank, ranks
from retrain.config.sections import Config, ConfigError, to_dict
from retrain.run import checkpoint
from retrain.runfiles import runlog

BASE = '[model]\nname = "tiny-random"\ndevice = "cpu"\n[training]\nbatch_size = 4\n'


def _explain(tmp_path, text: str, capsys) -> tuple[int, str]:
    path = tmp_path / "d.toml"
    path.write_text(text, encoding="utf-8")
    code = run_app(["explain", str(path)])
    out = capsys.readouterr()
    return code, (out.err + out.out).strip()


def test_defaults_one_rank_and_the_section_loads():
    cfg = Config()
    assert (cfg.distributed.nproc_per_node, cfg.distributed.timeout_s) == (1, 600.0)
    cfg, _ = loader.loads(BASE + '[distributed]\nnproc_per_node = "auto"\ntimeout_s = 30\n')
    assert cfg.distributed == DistributedConfig("auto", 30.0)
    assert "distributed" in to_dict(cfg) and to_dict(cfg)["distributed"]["timeout_s"] == 30.0


def test_ranks_resolves_auto_from_the_visible_gpus():
    assert ranks(DistributedConfig(3)) == 3
    assert ranks(DistributedConfig(3), visible_gpus=8) == 3
    assert ranks(DistributedConfig("auto"), visible_gpus=4) == 4
    assert ranks(DistributedConfig("auto"), visible_gpus=0) == 1  # a CPU: one rank


@pytest.mark.parametrize("batch,world,expected", [
    (4, 2, [2, 2]), (5, 2, [2, 3]), (7, 3, [2, 2, 3]), (3, 3, [1, 1, 1]), (8, 1, [8])])
def test_groups_per_rank_are_contiguous_blocks_of_whole_groups(batch, world, expected):
    counts = groups_per_rank(batch, world)
    assert counts == expected and sum(counts) == batch
    starts = [r * batch // world for r in range(world)]
    assert [b - a for a, b in zip(starts, [*starts[1:], batch], strict=True)] == counts


@pytest.mark.parametrize("table,said", [
    ("nproc_per_node = 0", "distributed.nproc_per_node: must be >= 1, got 0"),
    ('nproc_per_node = "all"', 'distributed.nproc_per_node: expected an integer or "auto", '
                               'got "all"'),
    ("nproc_per_node = 2.0", "distributed.nproc_per_node: expected an integer or \"auto\""),
    ("timeout_s = 0", "distributed.timeout_s: must be >= 1, got 0"),
    ("nproc_per_node = 8", "distributed.nproc_per_node: (8) is more than training.batch_size "
                           "(4): each rank takes whole prompt groups; lower nproc_per_node or "
                           "raise batch_size"),
])
def test_bad_values_are_one_line_naming_the_key(tmp_path, capsys, table, said):
    code, err = _explain(tmp_path, BASE + f"[distributed]\n{table}\n", capsys)
    assert code == 2 and said in err and "\n" not in err and "Traceback" not in err, err


def test_several_ranks_on_tinker_are_refused(tmp_path, capsys):
    text = '[backend]\nbackend = "tinker"\n[distributed]\nnproc_per_node = 2\n'
    code, err = _explain(tmp_path, text, capsys)
    assert code == 2 and "\n" not in err, err
    assert "distributed.nproc_per_node: = 2 needs backend = 'local'" in err and "Tinker" in err
    assert loader.loads(text.replace("= 2", "= 1"))[0].distributed.nproc_per_node == 1
    with pytest.raises(ConfigError, match="auto"):
        loader.loads(text.replace("= 2", '= "auto"'))  # auto could mean several


def test_off_policy_with_several_ranks_says_set_it_to_0(tmp_path, capsys):
    code, err = _explain(tmp_path, BASE + "max_steps_off_policy = 1\n[distributed]\n"
                                          "nproc_per_node = 2\n", capsys)
    assert code == 2 and "\n" not in err, err
    assert "training.max_steps_off_policy: is not supported with several ranks" in err
    assert err.endswith("set it to 0")


def test_backpressure_may_not_shrink_the_batch_below_the_ranks(tmp_path, capsys):
    code, err = _explain(tmp_path, BASE + "[backpressure]\nenabled = true\n[distributed]\n"
                                          "nproc_per_node = 2\n", capsys)
    assert code == 2 and "backpressure.min_batch_size: (1) is less than " \
        "distributed.nproc_per_node (2)" in err and "\n" not in err, err


def test_several_cpu_ranks_are_fine(tmp_path, capsys):
    code, out = _explain(tmp_path, BASE + "[distributed]\nnproc_per_node = 4\n", capsys)
    assert code == 0, out


def test_more_gpus_than_visible_on_cuda_is_refused(tmp_path, monkeypatch):
    """The count comes from torch only for a cuda device; a CPU device never asks."""
    seen = []

    def count(device):
        seen.append(device)
        return 1 if device == "cuda" else None

    monkeypatch.setattr(loader, "visible_gpus", count)
    path = tmp_path / "g.toml"
    path.write_text(BASE.replace('"cpu"', '"cuda"') + "[distributed]\nnproc_per_node = 2\n")
    with pytest.raises(ConfigError) as err:
        loader.read_file(path)
    assert str(err.value) == (f"{path}: distributed.nproc_per_node: (2) asks for 2 GPUs, 1 "
                              "visible on this machine (CUDA_VISIBLE_DEVICES); lower "
                              "nproc_per_node to 1 or use \"auto\"")
    path.write_text(BASE + "[distributed]\nnproc_per_node = 2\n")
    loader.read_file(path)  # device cpu: 2 ranks of their own cores
    assert seen == ["cuda", "cpu"]
    assert dist.gpu_issues(DistributedConfig(2), 2) == []
    assert dist.gpu_issues(DistributedConfig("auto"), 0) == []


def test_visible_gpus_never_imports_torch_for_a_cpu_device():
    code = ("import sys\nfrom retrain.config.distributed_section import visible_gpus\n"
            "assert visible_gpus('cpu') is None and visible_gpus('mps') is None\n"
            "assert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cuda_without_gpus_is_one_line_from_the_real_cli(tmp_path, cli_env, python):
    """Here torch sees no GPU: two ranks on cuda are refused before anything starts."""
    path = tmp_path / "g.toml"
    path.write_text(BASE.replace('"cpu"', '"cuda"') + "[distributed]\nnproc_per_node = 2\n")
    done = subprocess.run([python, "-m", "retrain", "explain", str(path)], env=cli_env,
                          capture_output=True, text=True, timeout=120)
    if "0 visible" not in done.stderr:
        pytest.skip(f"this machine has a GPU: {done.stderr.strip()[:200]}")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in \
        done.stderr, done.stderr
    assert "distributed.nproc_per_node: (2) asks for 2 GPUs, 0 visible" in done.stderr


def test_a_resume_may_change_the_ranks_but_not_the_training(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first, _ = loader.loads(BASE)
    (run_dir / runlog.CONFIG_FILE).write_text(loader.dumps_config(first), encoding="utf-8")
    more, _ = loader.loads(BASE + '[distributed]\nnproc_per_node = 2\ntimeout_s = 60\n')
    checkpoint._check_same_config(run_dir, more)  # allowed: the result does not change
    other, _ = loader.loads(BASE.replace("batch_size = 4", "batch_size = 6"))
    with pytest.raises(Exception, match="training.batch_size"):
        checkpoint._check_same_config(run_dir, other)

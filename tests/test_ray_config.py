"""[campaign] executor, ray_address, run_resources: validation, defaults, and that the local
executor (and `explain` of a local campaign) never imports Ray. No Ray needed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from retrain.campaign.plan import run_resources
from retrain.config import ConfigError
from retrain.config_file import loads

BASE = '[model]\nname = "tiny-random"\n[campaign]\nseeds = [1, 2]\n'


def test_defaults_are_local_with_resources_derived_from_the_run():
    cfg, plan = loads(BASE)
    assert plan.executor == "local" and plan.ray_address == ""
    assert run_resources(cfg, plan) == {"cpu": 1.0, "gpu": 0.0}
    threads = loads(BASE.replace('"tiny-random"', '"tiny-random"\nthreads = 3'))
    assert run_resources(*threads) == {"cpu": 3.0, "gpu": 0.0}
    cuda = loads(BASE.replace('"tiny-random"', '"tiny-random"\ndevice = "cuda"'))
    assert run_resources(*cuda)["gpu"] == 1.0
    auto = loads(BASE)  # device = "auto": a GPU only where the cluster has one
    assert run_resources(*auto, cluster_gpus=2)["gpu"] == 1.0
    given = loads(BASE + "run_resources = {cpu = 2, gpu = 0.5}\n")
    assert run_resources(*given, cluster_gpus=2) == {"cpu": 2.0, "gpu": 0.5}


def test_bad_values_name_the_key_and_the_fix():
    with pytest.raises(ConfigError) as err:
        loads(BASE + 'executor = "slurm"\nrun_resources = {cpu = -1, tpu = 1}\n', "x.toml")
    text = str(err.value)
    assert "x.toml" in text and "campaign.executor" in text and '"local", "ray"' in text
    assert "campaign.run_resources.cpu: expected a number >= 0, got -1" in text
    assert "campaign.run_resources.tpu: unknown resource" in text and "{cpu = 2" in text


def test_local_campaign_explain_does_not_import_ray(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(BASE)
    code = ("import sys\nfrom retrain.explain import build_report\n"
            f"r = build_report({str(path)!r})\n"
            "assert r.executor == 'local' and r.runs_at_once is None\n"
            "assert not any(m == 'ray' or m.startswith('ray.') for m in sys.modules), 'ray'\n"
            "import retrain.campaign.runner, retrain.trainer, retrain.status\n"
            "assert 'ray' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_executor_shortcut_on_the_command_line():
    from retrain.overrides import command_line_overrides

    assert command_line_overrides([], {"--executor": "ray"}) == {"campaign.executor": "ray"}
    with pytest.raises(ConfigError, match="--executor"):
        command_line_overrides([], {"--executor": "slurm"})

"""[campaign] executor, ray_address, run_resources: validation, defaults, and that the local
executor (and `explain` of a local campaign) never imports Ray. No Ray needed."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from retrain.campaign.plan import run_resources
from retrain.config.loader import loads
from retrain.config.sections import ConfigError

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
    code = ("import sys\nfrom retrain.cli.explain.dry_run import build_report\n"
            f"r = build_report({str(path)!r})\n"
            "assert r.executor == 'local' and r.runs_at_once is None\n"
            "assert not any(m == 'ray' or m.startswith('ray.') for m in sys.modules), 'ray'\n"
            "import retrain.campaign.runner, retrain.run.trainer, retrain.cli.status\n"
            "assert 'ray' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_executor_shortcut_on_the_command_line():
    from retrain.config.overrides import command_line_overrides

    assert command_line_overrides([], {"--executor": "ray"}) == {"campaign.executor": "ray"}
    with pytest.raises(ConfigError, match="--executor"):
        command_line_overrides([], {"--executor": "slurm"})


@pytest.mark.parametrize("address,words", [
    ("http://[::1", "unknown scheme 'http://'"),
    ("http://127.0.0.1:8265", "unknown scheme 'http://'"),
    ("ray://127.0.0.1:99999", "Port out of range"),
    ("garbage", "'garbage' is not a valid address"),
    ("ray://head", "'ray://head' is not a valid address"),
])
def test_malformed_ray_address_is_a_config_error(address, words):
    with pytest.raises(ConfigError) as err:
        loads(BASE + f'executor = "ray"\nray_address = "{address}"\n', "x.toml")
    text = str(err.value)
    assert "x.toml" in text and "campaign.ray_address" in text and words in text, text
    assert "host:port" in text and "ray://host:port" in text


def test_good_ray_addresses_load():
    for address in ("", "auto", "10.0.0.1:6379", "head.example:6379", "ray://head:10001",
                    "[::1]:6379"):
        assert loads(BASE + f'ray_address = "{address}"\n')[1].ray_address == address


def _listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


@pytest.mark.parametrize("address,words", [
    ("ray://nonexistent:1", "no Ray cluster answers at ray://nonexistent:1"),
    ("ray://127.0.0.1:1", "no Ray cluster answers at ray://127.0.0.1:1"),
    ("127.0.0.1:1", "no Ray cluster answers at 127.0.0.1:1"),
    ("ray://127.0.0.1:99999", "Port out of range"),
    ("http://[::1", "unknown scheme"),
    ("ray://127.0.0.1:{open}", "ray[client]"),  # answers, but Ray Client is not installed
])
def test_bad_ray_address_is_one_line_from_explain_and_run(tmp_path, cli_env, python, address,
                                                          words):
    """Each stops `explain` and the run within seconds: one line, exit 2, no traceback, and
    explain never claims a cluster will be started here."""
    ray = pytest.importorskip("ray", reason="Ray is not installed")
    sock = _listening()
    address = address.replace("{open}", str(sock.getsockname()[1]))
    if "{" not in words and "ray[client]" in words:
        from ray._private.utils import get_ray_client_dependency_error

        if get_ray_client_dependency_error() is None:
            pytest.skip("Ray Client is installed here")
    assert ray
    (tmp_path / "c.toml").write_text(BASE + f'executor = "ray"\nray_address = "{address}"\n'
                                     '[logging]\nlog_dir = "logs"\n')
    try:
        for command in (["explain", "c.toml"], ["c.toml"]):
            t0 = time.monotonic()
            proc = subprocess.run([python, "-m", "retrain", *command], cwd=tmp_path,
                                  env=cli_env, capture_output=True, text=True, timeout=120)
            took = time.monotonic() - t0
            err = proc.stderr.strip()
            assert proc.returncode == 2 and "Traceback" not in err, (command, err[-2000:])
            assert words in err and len(err.splitlines()) == 1, (command, err)
            assert "starts" not in proc.stdout + err, proc.stdout
            assert took < 30, (command, took)
    finally:
        sock.close()


def test_make_test_runs_the_ray_modules_in_their_groups(request):
    """`make test` (xdist --dist loadgroup) runs the Ray modules in two groups (conftest.py):
    three clusters started side by side on two cores missed their tests' deadlines. pytest 9.2
    with xdist 3.8 dropped every group silently (pytest-xdist#1386), hence pytest < 9.2."""
    if not request.config.getoption("loadgroup", False):
        pytest.skip("not under pytest-xdist --dist loadgroup")
    assert request.node.nodeid.endswith("@ray"), request.node.nodeid

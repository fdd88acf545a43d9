"""The command line itself: --version, --help everywhere, init, routing, light imports, and a
real end-to-end session in a temp folder."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from retrain import __version__
from retrain.cli.app import COMMANDS, _route, run_app
from tests import warm


def cli(args, capsys):
    code = run_app(args)
    out = capsys.readouterr()
    return code, out.out + out.err


def test_version(capsys):
    code, out = cli(["--version"], capsys)
    assert code == 0 and out.strip() == f"retrain {__version__}"


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_on_every_command(command, capsys):
    for flag in ("--help", "-h"):
        code, out = cli([command, flag] if command else [flag], capsys)
        assert code == 0 and "Usage: retrain" in out


def test_no_arguments_shows_help(capsys):
    code, out = cli([], capsys)
    assert "Usage: retrain" in out and code == 2  # usage: like click, a bare command exits 2


def test_init_list(capsys):
    code, out = cli(["init", "--list"], capsys)
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()] == ["quickstart", "experiment",
                                                              "campaign", "algorithms",
                                                              "environment"]


def test_init_writes_default_path_and_refuses_to_overwrite(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out = cli(["init"], capsys)
    assert code == 0 and "wrote quickstart.toml" in out and "retrain explain" in out
    (tmp_path / "quickstart.toml").write_text("# mine\n")
    code, out = cli(["init"], capsys)
    assert code == 2 and "already exists" in out and "--force" in out and "Traceback" not in out
    assert (tmp_path / "quickstart.toml").read_text() == "# mine\n"
    code, _ = cli(["init", "--force"], capsys)
    assert code == 0 and "smollm2" in (tmp_path / "quickstart.toml").read_text()
    code, out = cli(["init", "-t", "campaign", "sweep.toml"], capsys)
    assert code == 0 and (tmp_path / "sweep.toml").is_file()
    code, out = cli(["init", "--template", "nope"], capsys)
    assert code == 2 and "unknown template 'nope'" in out


def test_routing_a_file_means_run():
    assert _route(["x.toml", "--new"]) == ["run", "x.toml", "--new"]
    assert _route(["configs/x"]) == ["run", "configs/x"]
    assert _route(["status", "logs"]) == ["status", "logs"]
    assert _route(["--version"]) == ["--version"]


def test_mistyped_command_suggests_one(capsys):
    code, out = cli(["stauts"], capsys)
    assert code == 2 and "did you mean 'retrain status'" in out


def test_run_with_a_bad_config_fails_before_any_training(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nbatch_size = -1\n")
    code, out = cli([str(bad)], capsys)
    assert code == 2 and "training.batch_size" in out and "Traceback" not in out
    code, out = cli([str(tmp_path / "missing.toml")], capsys)
    assert code == 2 and "no such file" in out


def test_explain_takes_the_same_overrides_as_run(tmp_path, cli_env):
    campaign = tmp_path / "c.toml"
    campaign.write_text('[model]\nname = "tiny-random"\n[campaign]\nseeds = [1, 2]\n')
    args = [str(campaign), "--seed", "7", "--max-steps", "3", "--log-dir", str(tmp_path / "l"),
            "--executor", "ray", "--set", "training.batch_size=2"]
    # A child process: explain may look for a Ray cluster, which must not touch this one.
    out = warm.run([sys.executable, "-m", "retrain", "explain", *args, "--json"], env=cli_env,
                   capture_output=True, text=True, check=True).stdout
    report = json.loads(out)
    assert report["executor"] == "ray" and report["total_steps"] == 6
    assert report["settings"]["training.batch_size"] == 2
    assert report["settings"]["logging.log_dir"] == str(tmp_path / "l")
    bad = warm.run([sys.executable, "-m", "retrain", "explain", str(campaign),
                    "--executor", "slurm"], env=cli_env, capture_output=True, text=True)
    assert bad.returncode == 2 and '"local", "ray"' in bad.stderr + bad.stdout


def test_unknown_option_is_a_usage_error(capsys):
    code, out = cli(["status", "--bogus"], capsys)
    assert code == 2 and "No such option" in out


# pydantic: typer >= 0.29 imports it at start (+~200 ms here), hence typer < 0.29.
HEAVY = ("torch", "transformers", "peft", "tinker", "matplotlib", "numpy", "pydantic", "httpx")


def test_light_path_imports_nothing_heavy(tmp_path, cli_env):
    script = textwrap.dedent(f"""
        import sys
        from retrain.cli.app import run_app
        for args in (["--help"], ["init", "q.toml"], ["explain", "q.toml"],
                     ["explain", "q.toml", "--json"], ["status", "logs"], ["status", "--json"]):
            assert run_app(args) == 0, args
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
        print("HEAVY:", heavy)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=cli_env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY: []" in proc.stdout


def test_end_to_end_in_a_temp_folder(tmp_path, cli_env):
    def retrain(*args):
        return warm.run([sys.executable, "-m", "retrain", *args], capture_output=True,
                        text=True, env=cli_env, cwd=tmp_path, timeout=120)

    assert retrain("--version").stdout.strip() == f"retrain {__version__}"
    proc = retrain("init", "--template", "quickstart")
    assert proc.returncode == 0 and (tmp_path / "quickstart.toml").is_file()
    proc = retrain("explain", "quickstart.toml")
    assert proc.returncode == 0, proc.stderr
    assert "4 prompts x 8 completions = 32 completions" in proc.stdout
    assert "unknown: run a pilot" in proc.stdout and "\x1b[" not in proc.stdout
    proc = retrain("status")
    assert proc.returncode == 0 and "no such folder yet" in proc.stdout
    proc = retrain("explain", "quickstart.toml", "--set", "training.batchsize=4")
    assert proc.returncode == 2 and "did you mean 'training.batch_size'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_os_errors_become_one_line_with_the_right_exit_status(tmp_path, capsys, monkeypatch):
    """The one OSError -> message mapping: path, meaning and fix; 2 for setup, 1 for a run."""
    import errno

    from retrain.errors import user_error_from_os

    full = user_error_from_os(OSError(errno.ENOSPC, "No space left on device", "logs/x"))
    assert full.exit_code == 1 and "logs/x: no space left" in str(full)
    ro = user_error_from_os(OSError(errno.EROFS, "Read-only file system", "logs"),
                            "logging.log_dir")
    assert ro.exit_code == 2 and str(ro).startswith("logging.log_dir: logs: read-only")
    odd = user_error_from_os(OSError(errno.EMFILE, "Too many open files"))
    assert odd.exit_code == 1 and "Too many open files" in str(odd)

    import retrain.cli.launch

    def boom(*_a, **_k):
        raise OSError(errno.EACCES, "Permission denied", "logs/run/state.json")
    monkeypatch.setattr(retrain.cli.launch, "launch", boom)
    code, out = cli(["run", "x.toml"], capsys)
    assert code == 2 and out.startswith("error: logs/run/state.json: permission denied")
    assert "Traceback" not in out

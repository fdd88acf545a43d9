"""The `retrain` command line. Thin: parse, call one function, render. No logic here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from retrain import __version__
from retrain.errors import UserError

app = typer.Typer(
    name="retrain",
    help="TOML-first RL fine-tuning for language models.\n\n"
    "Run a config with `retrain FILE.toml` (same as `retrain run FILE.toml`).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

SetOpt = Annotated[list[str], typer.Option("--set", help="Override a key: section.key=value "
                                           "(repeatable).", metavar="SECTION.KEY=VALUE")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"retrain {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Show the version and exit.")] = False
          ) -> None:
    """TOML-first RL fine-tuning for language models."""


def _overrides(sets: list[str] | None, seed: int | None = None, max_steps: int | None = None,
               log_dir: str | None = None) -> dict:
    from retrain.config import parse_set_args

    out = parse_set_args(list(sets or []))
    for key, value in (("training.seed", seed), ("training.max_steps", max_steps),
                       ("logging.log_dir", log_dir)):
        if value is not None:
            out[key] = value
    return out


@app.command()
def run(
    config: Annotated[Path, typer.Argument(help="The TOML file: a single run or a campaign.")],
    set_: SetOpt = None,
    seed: Annotated[Optional[int], typer.Option(help="Shortcut for --set training.seed=N.")] = None,
    max_steps: Annotated[Optional[int], typer.Option(help="Shortcut for training.max_steps.")] = None,
    log_dir: Annotated[Optional[str], typer.Option(help="Shortcut for logging.log_dir.")] = None,
    new: Annotated[bool, typer.Option("--new", help="Start fresh instead of resuming.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Resume a campaign even if its matrix "
                                        "changed.")] = False,
) -> None:
    """Train: a single run, or every run of a campaign. Re-running resumes."""
    from retrain.launch import launch

    code = launch(config, _overrides(set_, seed, max_steps, log_dir), new=new, force=force)
    raise typer.Exit(code)


@app.command()
def init(
    path: Annotated[Optional[Path], typer.Argument(help="Where to write (default: "
                                                   "<template>.toml).")] = None,
    template: Annotated[str, typer.Option("--template", "-t", help="Template name.")] = "quickstart",
    list_: Annotated[bool, typer.Option("--list", help="List the templates.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Write a ready, commented config from a template."""
    from retrain import templates

    if list_:
        for name, about in templates.list_templates():
            typer.echo(f"{name:12s} {about}")
        return
    written = templates.write_template(template, path, force=force)
    typer.echo(f"wrote {written}\nnext: retrain explain {written}")


@app.command()
def explain(
    config: Annotated[Path, typer.Argument(help="The TOML file to dry-run.")],
    set_: SetOpt = None,
    json_: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Dry run: run matrix, completions per step, total steps, wall-time estimate."""
    from retrain import explain as explain_mod

    report = explain_mod.build_report(config, _overrides(set_))
    explain_mod.render(report, as_json=json_)


@app.command()
def status(
    logdir: Annotated[Path, typer.Argument(help="Folder to scan.")] = Path("logs"),
    json_: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    watch: Annotated[bool, typer.Option("--watch", help="Redraw live until Ctrl-C.")] = False,
) -> None:
    """What is running, what finished, what failed."""
    from retrain import status as status_mod

    status_mod.show(logdir, as_json=json_, watch=watch)


@app.command()
def plot(
    run_dir: Annotated[Path, typer.Argument(help="A run folder (logs/<run>).")],
    out: Annotated[Optional[Path], typer.Option(help="PNG path (default: RUN_DIR/usl.png).")] = None,
) -> None:
    """Draw the back-pressure picture: observations, fitted USL curve, p*, reward, step time."""
    from retrain.plot import plot_run

    typer.echo(f"wrote {plot_run(run_dir, out)}")


@app.command()
def serve(
    model: Annotated[str, typer.Option(help="Base model: built-in name, HF id or folder.")]
    = "smollm2-135m-instruct",
    host: Annotated[str, typer.Option(help="Interface to bind; anything but loopback is "
                                      "exposed to the network.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(help="Shared key clients must send "
                                                   "(or $RETRAIN_SERVE_API_KEY).")] = None,
    dtype: Annotated[str, typer.Option(help="Weights dtype.")] = "bfloat16",
) -> None:
    """Serve the Tinker API over the local backend (for the official tinker SDK)."""
    from retrain.serve import serve_forever

    serve_forever(model=model, host=host, port=port, api_key=api_key, dtype=dtype)


COMMANDS = {"run", "init", "explain", "status", "plot", "serve"}


def _route(argv: list[str]) -> list[str]:
    """`retrain FILE.toml ...` means `retrain run FILE.toml ...`."""
    if argv and argv[0] not in COMMANDS and not argv[0].startswith("-"):
        return ["run", *argv]
    return argv


def main() -> None:
    """Console entry point: errors the user can fix print one message and exit 2."""
    try:
        app(args=_route(sys.argv[1:]), prog_name="retrain", standalone_mode=True)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)

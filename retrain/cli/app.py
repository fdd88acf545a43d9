"""The `retrain` command line. Thin: parse, call one function, render. No logic here."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Annotated

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
    context_settings={"help_option_names": ["-h", "--help"]},
)

ConfigArg = Annotated[Path, typer.Argument(help="The TOML file: a single run or a campaign.",
                                           metavar="FILE")]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", help="Override a key: section.key=value (repeatable).",
    metavar="SECTION.KEY=VALUE")]
SeedOpt = Annotated[int | None, typer.Option(help="Shortcut for --set training.seed=N.")]
StepsOpt = Annotated[int | None, typer.Option(help="Shortcut for --set training.max_steps=N.")]
LogDirOpt = Annotated[str | None, typer.Option(help="Shortcut for --set logging.log_dir=DIR.")]
ExecutorOpt = Annotated[str | None, typer.Option(
    help="Shortcut for --set campaign.executor=NAME (local or ray).", metavar="NAME")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"retrain {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Show the version and exit.")] = False
          ) -> None:
    """TOML-first RL fine-tuning for language models."""


def _overrides(sets: list[str] | None, seed: int | None, max_steps: int | None,
               log_dir: str | None, executor: str | None) -> dict:
    from retrain.config.overrides import command_line_overrides

    return command_line_overrides(sets or [], {"--seed": seed, "--max-steps": max_steps,
                                               "--log-dir": log_dir, "--executor": executor})


@app.command()
def run(
    config: ConfigArg, set_: SetOpt = None, seed: SeedOpt = None, max_steps: StepsOpt = None,
    log_dir: LogDirOpt = None, executor: ExecutorOpt = None,
    new: Annotated[bool, typer.Option("--new", help="Start fresh instead of resuming.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Resume a campaign even if its matrix "
                                        "changed.")] = False,
) -> None:
    """Train: a single run, or every run of a campaign. Re-running resumes."""
    from retrain.cli.launch import launch

    code = launch(config, _overrides(set_, seed, max_steps, log_dir, executor), new=new,
                  force=force)
    raise typer.Exit(code)


@app.command()
def init(
    path: Annotated[Path | None, typer.Argument(help="Where to write (default: "
                                                "<template>.toml).", metavar="PATH")] = None,
    template: Annotated[str, typer.Option("--template", "-t",
                                          help="quickstart, experiment, campaign, "
                                               "algorithms or environment.")]
    = "quickstart",
    list_: Annotated[bool, typer.Option("--list", help="List the templates.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Write a ready, commented config from a template."""
    from retrain.cli import templates

    if list_:
        for name, about in templates.list_templates():
            typer.echo(f"{name:12s} {about}")
        return
    written = templates.write_template(template, path, force=force)
    typer.echo(f"wrote {written}\nnext: retrain explain {written}   (dry run)\n"
               f"      retrain {written}           (train)")


@app.command()
def explain(
    config: ConfigArg, set_: SetOpt = None, seed: SeedOpt = None, max_steps: StepsOpt = None,
    log_dir: LogDirOpt = None, executor: ExecutorOpt = None, json_: JsonOpt = False,
) -> None:
    """Dry run: settings, run matrix, completions per step, total steps, wall-time estimate.
    Takes the same overrides as `run`, so it shows exactly what that command would do."""
    from retrain.cli.explain import dry_run as explain_mod

    overrides = _overrides(set_, seed, max_steps, log_dir, executor)
    report = explain_mod.build_report(config, overrides)
    explain_mod.show(report, as_json=json_)


@app.command()
def status(
    logdir: Annotated[Path, typer.Argument(help="Folder to scan.", metavar="LOGDIR")]
    = Path("logs"),
    json_: JsonOpt = False,
    watch: Annotated[bool, typer.Option("--watch", help="Redraw live until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between redraws with --watch.",
                                            min=0.1)] = 2.0,
) -> None:
    """What is running, what finished, what failed (runs and campaigns under LOGDIR)."""
    from retrain.cli import status_view

    status_view.show(logdir, as_json=json_, watch=watch, interval=interval)


@app.command()
def compare(
    campaign_dir: Annotated[Path, typer.Argument(help="A campaign folder (logs/<campaign>).",
                                                 metavar="CAMPAIGN_DIR")],
    baseline: Annotated[str | None, typer.Option(
        help="The condition the others are compared with (default: the first).",
        metavar="NAME")] = None,
    last: Annotated[int | None, typer.Option(
        help="Final reward = mean over a run's last N steps (default: 10% of its steps).",
        metavar="N")] = None,
    threshold: Annotated[float | None, typer.Option(
        help="Reward whose first crossing is timed (default: median final reward).")] = None,
    json_: JsonOpt = False,
) -> None:
    """Compare a campaign's conditions across seeds: means, 95% intervals, verdicts."""
    from retrain.results import compare_view

    compare_view.show(campaign_dir, as_json=json_, baseline=baseline, last=last,
                      threshold=threshold)


@app.command(name="eval")
def eval_(
    run_dir: Annotated[Path, typer.Argument(help="A run folder (logs/<run>).",
                                            metavar="RUN_DIR")],
    step: Annotated[int | None, typer.Option(help="The checkpoint's step (default: the "
                                             "newest).")] = None,
    data: Annotated[Path | None, typer.Option(help="Prompts to evaluate on: a JSONL file of "
                                              '{"prompt", "answer"} lines.',
                                              metavar="FILE.jsonl")] = None,
    task: Annotated[str | None, typer.Option(help="A built-in task's held-out split "
                                             "(arithmetic or countdown).",
                                             metavar="NAME")] = None,
    reward: Annotated[str | None, typer.Option(help="Score with this [reward].type instead "
                                               "of the run's.", metavar="TYPE")] = None,
    samples: Annotated[int, typer.Option(help="Completions per prompt (> 1: pass@1 and "
                                         "pass@K).", metavar="K")] = 1,
    temperature: Annotated[float | None, typer.Option(
        help="Sampling temperature (default: greedy for one sample, the run's for K).",
        metavar="T")] = None,
    json_: JsonOpt = False,
) -> None:
    """Evaluate a checkpoint (default: on the run's held-out split, greedy, exactly as the
    run did); writes RUN_DIR/evals/<name>.jsonl and prints the score with its interval."""
    from retrain.results import evaluate

    evaluate.show(run_dir, evaluate.EvalRequest(step=step, data=data, task=task, reward=reward,
                                                samples=samples, temperature=temperature),
                  as_json=json_)


@app.command()
def sample(
    run_dir: Annotated[Path, typer.Argument(help="A run folder (logs/<run>).",
                                            metavar="RUN_DIR")],
    prompt: Annotated[str | None, typer.Argument(help="What to ask the trained model.",
                                                 metavar="PROMPT")] = None,
    step: Annotated[int | None, typer.Option(help="The checkpoint's step (default: the "
                                             "newest).")] = None,
    temperature: Annotated[float | None, typer.Option(
        help="Sampling temperature; 0 is greedy (default: the run's).", metavar="T")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="New tokens at most (default: the "
                                                   "run's).", metavar="N")] = None,
    interactive: Annotated[bool, typer.Option("--interactive", help="A chat loop with the "
                                              "chat template (Ctrl-D ends).")] = False,
) -> None:
    """Try a checkpoint: answer a prompt (streamed), or chat with --interactive."""
    from retrain.results import sample as sample_mod

    sample_mod.run(run_dir, sample_mod.SampleRequest(prompt=prompt, step=step,
                                                     temperature=temperature,
                                                     max_tokens=max_tokens,
                                                     interactive=interactive))


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="A run folder (logs/<run>).",
                                            metavar="RUN_DIR")],
    out: Annotated[Path, typer.Argument(help="A new folder to write.", metavar="OUT")],
    step: Annotated[int | None, typer.Option(help="The checkpoint's step (default: the "
                                             "newest).")] = None,
    merged: Annotated[bool, typer.Option("--merged", help="Merge the LoRA into the base "
                                         "weights (a plain transformers model).")] = False,
) -> None:
    """Export a checkpoint: the peft adapter, or with --merged a full model; plus a model
    card (README.md)."""
    from retrain.results import export as export_mod

    export_mod.show(run_dir, out, step=step, merged=merged)


@app.command()
def plot(
    run_dir: Annotated[Path, typer.Argument(help="A run folder (logs/<run>) or a campaign "
                                            "folder (logs/<campaign>).", metavar="DIR")],
    out: Annotated[Path | None, typer.Option(help="PNG path (default: RUN_DIR/usl.png, "
                                             "CAMPAIGN_DIR/curves.png).")] = None,
) -> None:
    """Draw a run's back-pressure picture (observations, fitted USL curve, p*, reward, step
    time), or a campaign's reward and eval curves per condition (mean over seeds, 95% band),
    and, where its API concurrency was "auto", the campaign's USL curve with the chosen cap
    (CAMPAIGN_DIR/concurrency.png)."""
    from retrain.campaign.concurrency import LOG_FILE
    from retrain.cli.plot import plot
    from retrain.cli.plot_concurrency import plot_concurrency

    typer.echo(f"wrote {plot(run_dir, out)}")
    if (run_dir / LOG_FILE).is_file():
        typer.echo(f"wrote {plot_concurrency(run_dir)}")


@app.command()
def serve(
    model: Annotated[str, typer.Option(help="Base model: built-in name, HF id or folder.")]
    = "smollm2-135m-instruct",
    host: Annotated[str, typer.Option(help="Interface to bind; anything but loopback is "
                                      "exposed to the network.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key: Annotated[str | None, typer.Option(help="Shared key clients must send "
                                                   "(or $RETRAIN_SERVE_API_KEY).")] = None,
    dtype: Annotated[str, typer.Option(
        help="Weights dtype: auto (bfloat16 where computed natively, else float32), "
             "bfloat16, float32 or float16.")] = "auto",
    delay_ms: Annotated[float, typer.Option(
        help="Added latency before every API request, in ms (tests and benchmarks: a "
             "stand-in for a network round trip).", min=0)] = 0.0,
    load_model: Annotated[str, typer.Option(
        help="Simulate a hosted endpoint's capacity curve: 'base_ms=B,sigma=S,kappa=K,"
             "fail_above=F'. With N API requests in flight each waits "
             "B*(1+S*(N-1)+K*N*(N-1)) ms on top of the real work, and one arriving while "
             "more than F are in flight gets HTTP 502 (tests and benchmarks of "
             "max_concurrent = \"auto\").")] = "",
    max_sessions: Annotated[int, typer.Option(
        help="Training clients alive at once (0 = no limit); one more gets HTTP 429 until "
             "a session finishes or stops heart-beating.", min=0)] = 0,
    adapter: Annotated[list[str] | None, typer.Option(
        help="Serve a run's checkpoint under a model name on the OpenAI-compatible routes: "
             "NAME=RUN_DIR[@STEP] (the newest kept step without @STEP). Repeatable.")] = None,
    max_queued_tokens: Annotated[int, typer.Option(
        help="Sampling taken on at once, in tokens of KV cache (rows x (prompt + "
             "max_tokens)); a request past it gets HTTP 429 (0 = what half the device's "
             "memory holds).", min=0)] = 0,
) -> None:
    """Serve the Tinker API (for the official tinker SDK) and an OpenAI-compatible API (for
    the openai client: /v1/chat/completions, /v1/completions, /v1/models) over the local
    backend."""
    from retrain.serve import serve_forever
    from retrain.serve.door.guard import LoadModel

    try:
        load = LoadModel.parse(load_model) if load_model.strip() else None
    except ValueError as exc:
        raise UserError(f"--load-model {load_model!r}: {exc}; expected e.g. "
                        "'base_ms=50,sigma=0.05,kappa=0.005,fail_above=24'") from None
    serve_forever(model=model, host=host, port=port, api_key=api_key, dtype=dtype,
                  delay_ms=delay_ms, max_sessions=max_sessions, load=load, adapters=adapter,
                  max_queued_tokens=max_queued_tokens)


COMMANDS = ("run", "init", "explain", "status", "compare", "plot", "eval", "sample",
            "export", "serve")


def _route(argv: list[str]) -> list[str]:
    """`retrain FILE.toml ...` means `retrain run FILE.toml ...`; a mistyped command is an
    error with a did-you-mean rather than a 'no such file'."""
    if not argv or argv[0] in COMMANDS or argv[0].startswith("-"):
        return argv
    first = argv[0]
    looks_like_file = first.endswith(".toml") or "/" in first or Path(first).exists()
    if not looks_like_file:
        close = difflib.get_close_matches(first, COMMANDS, n=1)
        hint = f"did you mean 'retrain {close[0]}'? " if close else ""
        raise UserError(f"'{first}' is neither a command nor a .toml file; {hint}"
                        "commands: " + ", ".join(COMMANDS) + " (see `retrain --help`)")
    return ["run", *argv]


def run_app(argv: list[str]) -> int:
    """Run the CLI on `argv` and return the exit status; user errors print one message."""
    try:
        app(args=_route(argv), prog_name="retrain", standalone_mode=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        raise  # stdout is gone: main() exits quietly
    except OSError as exc:  # a full disk, a read-only or blocked log folder: one clear line
        from retrain.errors import user_error_from_os

        err = user_error_from_os(exc)
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def main() -> None:
    """Console entry point."""
    from retrain.run.stop_request import exit_quietly_on_interrupt

    exit_quietly_on_interrupt()  # Ctrl-C while torch/transformers import: 130, one line
    try:
        code = run_app(sys.argv[1:])
        sys.stdout.flush()
    except BrokenPipeError:
        # `retrain status | head`: the reader left; exit quietly, as other tools do.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)

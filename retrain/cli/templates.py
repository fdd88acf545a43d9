"""`retrain init`: the commented starter configs in templates/, shipped inside the package.

The files live in the repository's top-level `templates/`; `retrain/cli/_templates` is a link to
that folder so the same files are package data in an installed wheel.
"""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path

from retrain.errors import UserError

# Name -> one line for `retrain init --list`, in the order a newcomer meets them.
TEMPLATES = {
    "quickstart": "single run, built-in model and task, smoke profile (runs on a laptop CPU)",
    "experiment": "single run, standard profile, every commonly tuned key spelled out",
    "campaign": "conditions x seeds, parallel workers, back-pressure section shown",
    "algorithms": "GRPO, DAPO, GSPO, CISPO, Dr. GRPO, PPO 2x2 raced by seed on 2-digit additions",
    "environment": "your own multi-turn environment (my_env.py, written next to it) + config",
}
# Files a template needs beside it, written into the same folder.
COMPANIONS = {"environment": ("my_env.py",)}


def list_templates() -> list[tuple[str, str]]:
    """(name, one-line description) of every template."""
    return list(TEMPLATES.items())


def template_text(name: str) -> str:
    """The text of template `name`; UserError naming the choices when it does not exist."""
    if name not in TEMPLATES:
        close = difflib.get_close_matches(name, list(TEMPLATES), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise UserError(f"unknown template '{name}'{hint}; templates are "
                        + ", ".join(TEMPLATES) + " (see `retrain init --list`)")
    return (resources.files("retrain.cli") / "_templates" / f"{name}.toml").read_text("utf-8")


def write_template(name: str, path: Path | None = None, *, force: bool = False) -> Path:
    """Write template `name` to `path` (default `<name>.toml`; a folder gets `<name>.toml` inside).

    Refuses to replace an existing file unless `force`.
    """
    text = template_text(name)
    target = Path(path) if path is not None else Path(f"{name}.toml")
    if target.is_dir():
        target = target / f"{name}.toml"
    folder = resources.files("retrain.cli") / "_templates"
    files = {target: text} | {target.parent / c: (folder / c).read_text("utf-8")
                              for c in COMPANIONS.get(name, ())}
    for path_ in files:
        if path_.exists() and not force:
            raise UserError(f"{path_} already exists; pass --force to overwrite it, "
                            "or give another path")
    for path_, body in files.items():
        try:
            path_.parent.mkdir(parents=True, exist_ok=True)
            path_.write_text(body, encoding="utf-8")
        except OSError as exc:
            raise UserError(f"{path_}: cannot write ({exc.strerror or exc})") from None
    return target

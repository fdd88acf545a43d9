"""The SFT rows `retrain explain` counts before a run: conversations that can never train a
token (a prompt longer than sft.max_tokens, an empty reply), found with the model's own
tokenizer and chat template, as the run renders them (environments/sft_datums.py). The
tokenizer is loaded only for a config with an [sft] stage, and only when the model is on this
machine already (never built, never downloaded); light_tokenizer.py reads it without
transformers where it can."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from retrain.cli.explain import light_tokenizer
from retrain.cli.explain.memory import model_folder
from retrain.config.sections import Config
from retrain.environments.ledger import Renderer
from retrain.environments.sft.data import SftData, never_trained


def never_trained_warning(cfg: Config, data: SftData, config_dir: Path) -> str:
    """The conversations of `data` that can never train, counted ("" when none); a note
    when the model's tokenizer is not on this machine to count them with."""
    tokenizer = local_tokenizer(cfg.model.name, config_dir)
    if tokenizer is None:
        return (f"sft.data: rows not checked against sft.max_tokens: the tokenizer of "
                f"model.name = {cfg.model.name!r} is not on this machine yet (the run loads it)")
    return never_trained(data, Renderer(tokenizer, data.data.chat_template),
                         cfg.sft.max_tokens)


def local_tokenizer(name: str, config_dir: Path) -> Any:
    """The model's tokenizer where the model is on this machine already (None otherwise)."""
    folder = model_folder(name, config_dir)
    if folder is None:
        return None
    light = light_tokenizer.load(folder)  # the common case: no transformers, no torch
    if light is not None:
        return light
    from transformers import AutoTokenizer  # the run's own loader (imports torch: ~3 s)

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError):
        return None

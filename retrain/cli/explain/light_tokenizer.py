"""A tokenizer for `retrain explain` to count tokens with, without transformers (whose import
pulls in torch: ~3 s of a 3.5 s explain). It reads the model folder's `tokenizer.json` with the
`tokenizers` library that transformers' fast tokenizers wrap, and renders the chat template
with jinja2 as transformers does (a sandbox, trim_blocks and lstrip_blocks, its `tojson`,
`raise_exception` and `strftime_now`, the special tokens as variables), then encodes the text
without adding special tokens, as `apply_chat_template(tokenize=True)` does.

`load` returns None where this cannot stand in for the real tokenizer (no tokenizer.json, a
chat template that does not compile here): explain then loads the real one.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
            "mask_token")


class LightTokenizer:
    """The calls ledger.Renderer makes: `chat_template`, `apply_chat_template`, `__call__`."""

    def __init__(self, encoder: Any, chat_template: str | None, template: Any,
                 special: dict[str, str]):
        self.encoder, self.chat_template = encoder, chat_template
        self._template, self._special = template, special

    def __call__(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.encoder.encode(text, add_special_tokens=add_special_tokens).ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, **extra: Any) -> list[int] | str:
        text = self._template.render(messages=messages,
                                     add_generation_prompt=add_generation_prompt,
                                     **self._special, **extra)
        return self(text, add_special_tokens=False) if tokenize else text


def load(folder: Path) -> LightTokenizer | None:
    """The light tokenizer of a model folder, or None (then the real one is needed)."""
    try:
        from tokenizers import Tokenizer

        encoder = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        legacy = folder / "special_tokens_map.json"  # transformers merges it in, if present
        if legacy.is_file():
            config = {**json.loads(legacy.read_text(encoding="utf-8")), **config}
        source = _template_source(folder, config)
        template = _compile(source) if source else None
    except Exception:  # noqa: BLE001 (anything this cannot read: the real loader decides)
        return None
    return LightTokenizer(encoder, source, template, _special_tokens(config))


def _template_source(folder: Path, config: dict) -> str | None:
    """The chat template transformers would pick: chat_template.jinja, else the config's."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    found = config.get("chat_template")
    if isinstance(found, list):  # named templates: transformers uses "default"
        found = next((t.get("template") for t in found if t.get("name") == "default"), None)
    if found is not None and not isinstance(found, str):
        raise ValueError("a chat template that is not text")
    return found


def _special_tokens(config: dict) -> dict[str, str]:
    out = {}
    for name in _SPECIAL:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[name] = value
    return out


def _compile(source: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        from jinja2.exceptions import TemplateError

        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)

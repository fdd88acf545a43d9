"""`retrain sample RUN_DIR "prompt"`: try a checkpoint. The prompt goes through the chat
template as the run's prompts did (the run's data.instruction is not added); tokens are
printed as they are drawn. `--interactive` keeps a conversation going until EOF or "exit".

Loads only what sampling needs: no trainer, no scorer, no optimizer.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from retrain.errors import UserError
from retrain.results import run_checkpoint

EXIT_WORDS = ("exit", "quit")


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | None = None
    step: int | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    interactive: bool = False


def _check(req: SampleRequest) -> None:
    if req.interactive and req.prompt:
        raise UserError("give a prompt or --interactive, not both")
    if not req.interactive and not (req.prompt or "").strip():
        raise UserError('give a prompt: retrain sample RUN_DIR "What is 3 + 4?" '
                        "(or --interactive for a chat)")
    if req.temperature is not None and not (0 <= req.temperature <= 10):
        raise UserError(f"--temperature {req.temperature}: give a value in [0, 10]")
    if req.max_tokens is not None and req.max_tokens < 1:
        raise UserError(f"--max-tokens {req.max_tokens}: give a number >= 1")


def render(tokenizer: Any, messages: list[dict], chat_template: bool) -> list[int]:
    """Token ids of a conversation ending with the user's turn."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                            tokenize=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
    else:
        ids = tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
    return [int(t) for t in ids]


def _check_context(policy: Any, ids: list[int], max_tokens: int, what: str) -> None:
    """Refuse, before any output, a reply that would run past the model's context."""
    from retrain.backends.base import context_overflow

    why = context_overflow(len(ids), max_tokens, policy.max_context)
    if why:
        raise UserError(f"{what}: {why}; shorten it or give a smaller --max-tokens")


def reply(policy: Any, ids: list[int], params: Any, out: TextIO) -> str:
    """Stream one completion to `out`; return its text."""
    tokens: list[int] = []
    shown = ""
    for tok in policy.stream(ids, params):
        tokens.append(tok)
        text = policy.tokenizer.decode(tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            out.write(text[len(shown):])
            out.flush()
            shown = text
    text = policy.tokenizer.decode(tokens, skip_special_tokens=True)
    out.write(text[len(shown):] + "\n")
    out.flush()
    return text


def run(run_dir: Path, req: SampleRequest, out: TextIO | None = None,
        read: Any = input) -> None:
    from retrain.results.policy import LocalPolicy

    out = out or sys.stdout
    run_dir = run_checkpoint.check_run_dir(run_dir)
    _check(req)
    cfg = run_checkpoint.run_config(run_dir)
    with run_checkpoint.held(run_dir, req.step) as ckpt:
        if ckpt.is_tinker:  # sampled through the SDK; the service answers whole completions
            from retrain.results.tinker_policy import TinkerPolicy

            policy: Any = TinkerPolicy.load(cfg, ckpt)
        else:
            policy = LocalPolicy.load(cfg, ckpt, run_dir)
    try:
        _converse(policy, cfg, ckpt, run_dir, req, out, read)
    finally:
        policy.close()


def _converse(policy: Any, cfg: Any, ckpt: Any, run_dir: Path, req: SampleRequest,
              out: TextIO, read: Any) -> None:
    from retrain.backends.base import SamplingParams

    params = SamplingParams(
        max_tokens=req.max_tokens or cfg.training.max_tokens,
        temperature=cfg.training.temperature if req.temperature is None else req.temperature,
        seed=cfg.training.seed, stop_strings=tuple(cfg.training.stop))
    if not req.interactive:
        ids = render(policy.tokenizer, [{"role": "user", "content": req.prompt}],
                     cfg.data.chat_template)
        _check_context(policy, ids, params.max_tokens, "the prompt")
        reply(policy, ids, params, out)
        return
    out.write(f"step {ckpt.step} of {run_dir}; temperature {params.temperature:g}, "
              f"{params.max_tokens} tokens a reply. Ctrl-D or 'exit' ends.\n")
    messages: list[dict] = []
    while True:
        try:
            line = read("> ")
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return
        if line.strip().lower() in EXIT_WORDS:
            return
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        ids = render(policy.tokenizer, messages, cfg.data.chat_template)
        _check_context(policy, ids, params.max_tokens, "the conversation")
        text = reply(policy, ids, params, out)
        messages.append({"role": "assistant", "content": text})

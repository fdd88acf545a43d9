"""The token ledger of one episode: one growing sequence, a mask on the model's own tokens.

    [prompt (mask 0)] [reply 1 as sampled (mask 1)] [env part (mask 0)] [reply 2 ...] ...

- The model's tokens are appended exactly as sampled, with the sampler's log-probs. They are
  never re-encoded: re-encoding " hel"+"lo" gives " hello", another sequence.
- An environment's messages are appended as the tokens the chat template adds for them: the
  history rendered with the new messages (and the generation prompt) minus the history
  rendered without them. Before that comes what the template writes after an assistant
  message (SmolLM2: `<|im_end|>\n`) less what the model already sampled of it (its
  `<|im_end|>`): so a reply that stopped contributes `\n`, a cut reply the whole closing.
- When the re-render does not extend the previous render (a template that rewrites history),
  the environment's tokens come from a bridge: the same difference over a fixed dummy
  history. Bridges are counted.

No torch: the tokenizer is passed in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from retrain.environments.protocol import Message
from retrain.environments.tools.render import for_template

_DUMMY: list[Message] = [{"role": "user", "content": "Hello"},
                         {"role": "assistant", "content": "World!"}]


class Renderer:
    """Messages -> token ids with the tokenizer's chat template (or the plain text of the
    contents, one per line, when there is none or `chat_template` is off)."""

    def __init__(self, tokenizer: Any, chat_template: bool = True):
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None) if chat_template else None
        self.chat = isinstance(template, str) and bool(template)
        self.template_has_tools = self.chat and "tools" in template
        self.closing = self._closing()

    def render(self, messages: list[Message], generation: bool,
               tools: list[dict] | None = None) -> list[int]:
        messages, tools = for_template(encodable(messages), encodable(tools),
                                       self.template_has_tools)
        if not self.chat:
            return token_ids(self.tokenizer("\n".join(m["content"] for m in messages)))
        extra = {"tools": tools} if tools and self.template_has_tools else {}
        return token_ids(self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation, tokenize=True, **extra))

    def _closing(self) -> list[int]:
        """The tokens the template writes after an assistant message's content."""
        if not self.chat:
            return []
        prompt = self.render(_DUMMY[:1], generation=True)
        full = self.render(_DUMMY, generation=False)
        content = token_ids(self.tokenizer("World!", add_special_tokens=False))
        body = full[len(prompt):]
        if full[:len(prompt)] != prompt or body[:len(content)] != content:
            return []
        return body[len(content):]

    def env_part(self, history: list[Message], new: list[Message], stopped_on: int | None,
                 tools: list[dict] | None = None) -> tuple[list[int], bool]:
        """(tokens to append after the last reply for the messages `new`, whether a bridge
        was needed). `history` ends with that reply; `stopped_on` is its last sampled token
        when it ended on a stop token (None when it was cut at max_tokens)."""
        closing = self.closing
        tail = closing[1:] if closing and stopped_on == closing[0] else closing
        before = self.render(history, generation=False, tools=tools)
        after = self.render(history + new, generation=True, tools=tools)
        if after[:len(before)] == before and before[len(before) - len(closing):] == closing:
            return tail + after[len(before):], False
        before = self.render(_DUMMY, generation=False, tools=tools)
        after = self.render(_DUMMY + new, generation=True, tools=tools)
        if after[:len(before)] == before:
            return tail + after[len(before):], True
        return tail + self.render(new, generation=True, tools=tools), True


_SURROGATE = re.compile("[\ud800-\udfff]")


def encodable(value: Any) -> Any:
    """`value` with every string made encodable as UTF-8: a lone surrogate (a tool returning
    os.listdir() of a latin-1 file name) becomes U+FFFD, as errors="replace" would."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {k: encodable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [encodable(v) for v in value]
    return value


def token_ids(encoded: Any) -> list[int]:
    """The ids of what a tokenizer call returned: a list, or transformers' encoding."""
    ids = encoded if isinstance(encoded, list) else encoded["input_ids"]
    return [int(t) for t in ids]


@dataclass
class Ledger:
    """One episode's sequence; `mask` is 1 exactly on sampled tokens."""

    tokens: list[int] = field(default_factory=list)
    mask: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def add_fixed(self, ids: list[int]) -> None:
        """Prompt or environment tokens: mask 0, log-prob 0."""
        self.tokens += ids
        self.mask += [0.0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def add_sampled(self, ids: list[int], logprobs: list[float]) -> None:
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} sampled tokens but {len(logprobs)} log-probs")
        self.tokens += ids
        self.mask += [1.0] * len(ids)
        self.logprobs += [float(x) for x in logprobs]

    @property
    def sampled_tokens(self) -> int:
        return int(sum(self.mask))

    @property
    def context_tokens(self) -> int:
        """The tokens the model did not sample: the prompt and every environment part."""
        return len(self.tokens) - self.sampled_tokens

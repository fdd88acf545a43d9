"""How tools reach the chat template: the template's own tool format, or the text protocol.

Environments speak canonical messages: a tool result is {"role": "tool", "name": ...,
"content": ...}. The rollout renders every history through `for_template`:

- a template that declares tools (it mentions `tools`, like Qwen's or Hermes') gets the
  messages unchanged and the schemas as `apply_chat_template(..., tools=schemas)`;
- any other template (SmolLM2's) gets the **text protocol**: a system message that lists the
  tools and shows the call format, and each tool result as a user message
  `<tool_response>\n...\n</tool_response>`.

Either way the model calls a tool by writing
`<tool_call>{"name": "lookup", "arguments": {"key": "apple"}}</tool_call>` (calls.py).
Pure and deterministic, so rendering with and without new messages differs only by them.
"""

from __future__ import annotations

Message = dict[str, str]

TEXT_PROTOCOL_HEADER = (
    "You can call tools. To call one, reply with only\n"
    '<tool_call>{"name": "TOOL", "arguments": {"ARG": VALUE}}</tool_call>\n'
    "and the result comes back in <tool_response></tool_response>. When you know the answer, "
    "reply without a tool call.\nTools:")


def template_declares_tools(chat_template: str | None) -> bool:
    """Whether a Jinja chat template renders a `tools` list itself."""
    return bool(chat_template) and "tools" in chat_template


def for_template(messages: list[Message], schemas: list[dict] | None,
                 template_tools: bool) -> tuple[list[Message], list[dict] | None]:
    """(messages, tools) to hand to apply_chat_template; tools is None when it must not be
    passed."""
    if not schemas:
        return messages, None
    if template_tools:
        return messages, schemas
    return to_text_protocol(messages, schemas), None


def to_text_protocol(messages: list[Message], schemas: list[dict]) -> list[Message]:
    """The history for a template without tools: tool list in the system message, tool
    results as user messages."""
    out = [_as_user(m) if m.get("role") == "tool" else m for m in messages]
    listing = describe_tools(schemas)
    if out and out[0].get("role") == "system":
        return [{**out[0], "content": out[0]["content"] + "\n\n" + listing}, *out[1:]]
    return [{"role": "system", "content": listing}, *out]


def describe_tools(schemas: list[dict]) -> str:
    """The text protocol's tool list: header, then one line per tool."""
    lines = [TEXT_PROTOCOL_HEADER]
    for schema in schemas:
        fn = schema.get("function", schema)
        props = fn.get("parameters", {}).get("properties", {})
        params = ", ".join(f"{name}: {prop.get('type', 'any')}" for name, prop in props.items())
        lines.append(f"- {fn['name']}({params}): {fn.get('description', '')}")
        for name, prop in props.items():
            if prop.get("description"):
                lines.append(f"    {name}: {prop['description']}")
    return "\n".join(lines)


def _as_user(message: Message) -> Message:
    return {"role": "user",
            "content": f"<tool_response>\n{message.get('content', '')}\n</tool_response>"}


def tool_message(name: str, content: str) -> Message:
    """A tool result in canonical form."""
    return {"role": "tool", "name": name, "content": content}


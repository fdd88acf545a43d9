"""The SFT stage's pure parts: the datum builder weighs only the assistant's tokens (the tiny
model's ChatML template, without a template, a template that rewrites earlier turns, a cut),
the [sft.data] conversations from the [data] loaders, the step count, and the [sft] checks."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from retrain.config.sections import ConfigError, from_dict
from retrain.config.sft_section import SftConfig
from retrain.environments.ledger import Renderer
from retrain.environments.sft.data import load_sft, sft_steps
from retrain.environments.sft.datums import sft_example, weighted_tokens
from retrain.errors import UserError

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "and 4+4?"},
        {"role": "assistant", "content": "eight"}]


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def weighted_text(tok, tokens, weights) -> str:
    """The weighted tokens decoded, runs joined by '|'."""
    runs, run = [], []
    for t, w in zip(tokens, weights, strict=True):
        if w:
            run.append(t)
        elif run:
            runs, run = [*runs, run], []
    runs += [run] if run else []
    return "|".join(tok.decode(r) for r in runs)


def test_only_the_assistant_turns_and_their_end_token_weigh(tok):
    tokens, weights, skipped = weighted_tokens(Renderer(tok), CHAT)
    assert tokens == Renderer(tok).render(CHAT, generation=False)
    assert skipped == 0
    # the replies and the <|im_end|> the sampler stops on; not the newline after it, never
    # the system prompt, the user turns or the role headers
    assert weighted_text(tok, tokens, weights) == "5<|im_end|>|eight<|im_end|>"
    unweighted = tok.decode([t for t, w in zip(tokens, weights, strict=True) if not w])
    assert "Be brief." in unweighted and "and 4+4?" in unweighted
    assert unweighted.count("<|im_start|>assistant\n") == 2


def test_the_datum_is_shifted_with_the_weights_on_its_targets(tok):
    example = sft_example(Renderer(tok), CHAT, max_tokens=1000)
    tokens, weights, _ = weighted_tokens(Renderer(tok), CHAT)
    d = example.datum()
    assert d.input_tokens == tokens[:-1] and d.target_tokens == tokens[1:]
    assert d.weights == d.mask == d.advantages == [float(w) for w in weights[1:]]
    assert d.logprobs == [0.0] * len(d)
    assert example.trained_tokens == sum(weights) and not example.truncated
    assert example.tokens == len(tokens)


def test_a_long_conversation_is_cut_to_max_tokens(tok):
    full = sft_example(Renderer(tok), CHAT, max_tokens=1000)
    cut = sft_example(Renderer(tok), CHAT, max_tokens=full.tokens - 3)
    assert cut.truncated and len(cut.datum()) == full.tokens - 4
    assert cut.datum().weights == full.datum().weights[:len(cut.datum())]
    # the cut took the newline (weight 0), <|im_end|> and the "t" of "eight"
    assert cut.trained_tokens == full.trained_tokens - 2
    assert sft_example(Renderer(tok), CHAT, max_tokens=1).datum() is None


class CountingRenderer(Renderer):
    """The real renderer, counting the characters it tokenizes."""

    rendered = 0

    def render(self, messages, generation, tools=None):
        self.rendered += sum(len(m["content"]) for m in messages)
        return super().render(messages, generation, tools)


def test_a_prompt_past_the_cut_is_rendered_once_and_trains_nothing(tok):
    huge = "12 + 34? " * 20_000  # 180k characters
    chat = [{"role": "user", "content": huge}, {"role": "assistant", "content": "46"}]
    renderer = CountingRenderer(tok)
    example = sft_example(renderer, chat, max_tokens=64)
    assert example.trained_tokens == 0 and example.truncated and example.tokens == 64
    assert example.datum().weights == [0.0] * 63
    assert renderer.rendered < 1.1 * len(huge)  # the prompt once: not the 3 renders of a turn
    short = sft_example(Renderer(tok), [{"role": "user", "content": "12 + 34?"},
                                        {"role": "assistant", "content": "46"}], max_tokens=64)
    assert short.trained_tokens > 0


def test_without_a_template_the_reply_and_eos_weigh(tok):
    renderer = Renderer(tok, chat_template=False)
    messages = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]
    tokens, weights, _ = weighted_tokens(renderer, messages, eos=tok.eos_token_id)
    assert tokens[-1] == tok.eos_token_id and weights[-1] == 1
    assert tok.decode([t for t, w in zip(tokens, weights, strict=True) if w]) == \
        f"\n5{tok.eos_token}"


def test_a_turn_the_template_rewrites_later_is_counted_not_guessed(tok):
    """A template that empties earlier replies (as reasoning templates strip their thinking):
    the last reply is located and weighted, the rewritten one is skipped and counted."""
    class Rewriting:
        chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                         "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}"
                         "{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

        def __call__(self, text, **kw):
            return tok(text, **kw)

        def apply_chat_template(self, messages, **kw):
            return tok.apply_chat_template(messages, chat_template=self.chat_template, **kw)

    renderer = Renderer(Rewriting())
    tokens, weights, skipped = weighted_tokens(renderer, CHAT)
    assert skipped == 1
    assert weighted_text(tok, tokens, weights) == "eight<|im_end|>"


def write_jsonl(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def sft(**data) -> SftConfig:
    return SftConfig(data=data, steps=2)


def test_jsonl_rows_become_conversations(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}, {"prompt": "Hi", "answer": "Hello"}])
    data = load_sft(sft(path="c.jsonl", instruction="Answer briefly."), tmp_path)
    assert data.rows == 2 and data.where.endswith("c.jsonl")
    first, second = data.conversations
    assert first[:-1] == [*CHAT[:3], {"role": "user", "content": "and 4+4?\nAnswer briefly."}]
    assert first[-1] == {"role": "assistant", "content": "eight"}
    assert second == [{"role": "user", "content": "Hi\nAnswer briefly."},
                      {"role": "assistant", "content": "Hello"}]


def test_hf_rows_become_conversations(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    pq.write_table(pa.table({"q": ["2+3?", "1+1?"], "a": ["5", "2"]}), tmp_path / "t.parquet")
    data = load_sft(sft(source="hf", path="t.parquet", prompt_field="q", answer_field="a"),
                    tmp_path)
    assert data.conversations[1] == [{"role": "user", "content": "1+1?"},
                                     {"role": "assistant", "content": "2"}]
    with pytest.raises(UserError) as err:
        load_sft(sft(source="hf", path="t.parquet", prompt_field="question"), tmp_path)
    assert str(err.value).startswith("sft.data.prompt_field = 'question'")
    assert "'q', 'a'" in str(err.value)


def test_bad_sft_data_is_one_line_naming_the_key_or_the_row(tmp_path):
    with pytest.raises(UserError) as err:
        load_sft(sft(path="missing.jsonl"), tmp_path)
    assert str(err.value).startswith("sft.data.path: ") and "does not exist" in str(err.value)
    write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT},
                                       {"messages": CHAT[:2]}])  # no assistant turn
    with pytest.raises(UserError) as err:
        load_sft(sft(path="c.jsonl"), tmp_path)
    assert "c.jsonl:2" in str(err.value) and "assistant turn" in str(err.value)
    assert "\n" not in str(err.value)


def test_steps_or_epochs():
    assert sft_steps(SftConfig(data={"path": "x"}, steps=7), 100) == 7
    assert sft_steps(SftConfig(data={"path": "x"}, epochs=2, batch_size=8), 20) == 5


@pytest.mark.parametrize(("sft_table", "training", "fragment"), [
    ({"steps": 3, "epochs": 1, "data": {"path": "c.jsonl"}}, {}, "sft.epochs: give sft.steps"),
    ({"data": {"path": "c.jsonl"}}, {}, "sft.steps: an SFT stage needs"),
    ({"steps": 3}, {}, "sft.steps: is set but [sft.data] is empty"),
    ({"steps": 3, "data": {"pth": "c.jsonl"}}, {}, "did you mean 'path'"),
    ({"steps": 3, "data": {"source": "hf"}}, {}, "sft.data.path: source 'hf' needs a path"),
    ({"steps": 3, "data": {"path": "c.jsonl", "source": "arithmetic"}}, {}, "sft.data.source"),
    ({"steps": 3, "lr": 0, "data": {"path": "c.jsonl"}}, {}, "sft.lr: must be > 0"),
    ({}, {"max_steps": 0}, "training.max_steps: is 0 and there is no [sft] stage"),
])
def test_sft_config_errors(sft_table, training, fragment):
    with pytest.raises(ConfigError) as err:
        from_dict({"sft": sft_table, "training": training}, "c.toml")
    assert fragment in str(err.value)


def test_an_sft_run_may_have_no_rl_steps():
    cfg = from_dict({"sft": {"steps": 3, "data": {"path": "c.jsonl"}},
                     "training": {"max_steps": 0}}, "c.toml")
    assert cfg.sft.enabled and cfg.training.max_steps == 0


def test_a_conversation_the_template_refuses_is_one_line(tiny_model, tmp_path):
    """A template that refuses a system turn (as Gemma's does) stops the stage with the row."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from retrain.backends.base import TokenUsage
    from retrain.config.sections import Config
    from retrain.environments.sft.data import SftData, data_config
    from retrain.run.record import RunRecord
    from retrain.run.run_facts import RunFacts
    from retrain.run.sft import SftStage

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception("
                         "'System role not supported') }}{% endif %}" + tok.chat_template)
    cfg = Config()
    cfg.sft = sft(path="c.jsonl")
    data = SftData([CHAT[1:], CHAT], "c.jsonl", data_config(cfg.sft))
    backend = SimpleNamespace(tokenizer=tok, max_context=None, token_usage=TokenUsage())
    stage = SftStage(cfg.sft, cfg.training, cfg.cost, RunRecord.of(cfg), data, tmp_path,
                     backend, tmp_path / "c.toml", RunFacts(sft_steps=1, digests=[]))
    assert stage._example(0).trained_tokens > 0  # no system turn: rendered
    with pytest.raises(UserError) as err:
        stage._example(1)
    assert str(err.value).startswith("sft.data: conversation 2 of c.jsonl cannot be rendered")
    assert "System role not supported" in str(err.value) and "\n" not in str(err.value)

"""SFT rows that can never train a token: an empty reply (not trained: it would only teach
stopping at once) and a prompt longer than sft.max_tokens, found with one render per row the
way the run finds them, counted by `retrain explain` with their rows (numbered from 1), said
once by the run; and `sft_epoch` is the epoch of the step's first row."""

from __future__ import annotations

import json

import pytest

from retrain.config.sft_section import SftConfig
from retrain.environments.ledger import Renderer
from retrain.environments.sft.data import load_sft, never_trained
from retrain.environments.sft.datums import EMPTY, LONG, never_trains, sft_example

USER = {"role": "user", "content": "What is 2 + 3?"}
LONG_USER = {"role": "user", "content": "What is 2 + 3? " * 40}  # 619 tokens (tiny-random)
MAX = 200  # sft.max_tokens: a two-turn chat of USER fits, LONG_USER does not


def reply(text: str) -> dict:
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


CASES = [
    ([USER, reply("5")], None),
    ([USER, reply("")], EMPTY),
    ([USER, reply("  \n")], EMPTY),
    ([USER, reply(""), USER, reply("5")], None),         # the second reply trains
    ([LONG_USER, reply("5")], LONG),
    ([USER, reply(""), LONG_USER, reply("5")], LONG),    # its first real reply is past the cut
]


@pytest.mark.parametrize(("chat", "why"), CASES)
@pytest.mark.parametrize("template", [True, False])
def test_never_trains_agrees_with_the_datum_the_run_builds(tok, chat, why, template):
    renderer = Renderer(tok, chat_template=template)
    example = sft_example(renderer, chat, max_tokens=MAX, eos=tok.eos_token_id)
    assert never_trains(renderer, chat, MAX) == why
    assert (example.trained_tokens == 0) == (why is not None), example.trained_tokens


def test_an_empty_reply_weighs_nothing_not_its_end_of_turn(tok):
    for template in (True, False):
        example = sft_example(Renderer(tok, chat_template=template), [USER, reply("")], MAX,
                              eos=tok.eos_token_id)
        assert example.trained_tokens == 0 and example.datum() is not None


def write_rows(folder, chats: list[list[dict]]) -> None:
    (folder / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n"
                                               for c in chats))


def test_explain_counts_them_by_why_with_rows_from_one(tmp_path, tok):
    chats = [[USER, reply(str(i))] for i in range(8)]
    chats[2], chats[6], chats[4] = [LONG_USER, reply("5")], [LONG_USER, reply("5")], \
        [USER, reply("")]
    write_rows(tmp_path, chats)
    data = load_sft(SftConfig(data={"path": "chat.jsonl"}, steps=1), tmp_path)
    note = never_trained(data, Renderer(tok), MAX)
    assert note == (f"sft.data: 3 of 8 conversations of {tmp_path / 'chat.jsonl'} can never "
                    "train a token: 2 with a prompt longer than sft.max_tokens = 200 (rows 3, "
                    "7); 1 with an empty reply (row 5); the run skips them (fix or drop those "
                    "rows, or raise sft.max_tokens)")
    assert never_trained(data, Renderer(tok), 4096).startswith(
        "sft.data: 1 of 8 conversations")
    write_rows(tmp_path, chats[:2])
    assert never_trained(load_sft(SftConfig(data={"path": "chat.jsonl"}, steps=1), tmp_path),
                         Renderer(tok), MAX) == ""


def test_a_plain_sft_run_says_an_empty_reply_once_and_numbers_epochs_by_first_row(
        tmp_path, tiny_model):
    """4 rows, 2 a step, 3 steps: step 2 ends epoch 0 (its rows are epoch 0's), step 3 starts
    epoch 1. Row 2's empty reply trains nothing and is said once, though every epoch meets it."""
    from tests.run_helpers import rows, run_in_process, write_config

    write_rows(tmp_path, [[USER, reply("5")], [USER, reply("")], [USER, reply("five")],
                          [USER, reply("5.0")]])
    path = write_config(tmp_path, training={"max_steps": 0},
                        sft={"steps": 3, "batch_size": 2, "lr": 0.01, "max_tokens": MAX,
                             "data": {"path": "chat.jsonl", "shuffle": False}})
    done = run_in_process([path.name], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    got = rows(tmp_path / "logs" / "run")
    assert [r["sft_epoch"] for r in got] == [0, 0, 1]
    assert [r["sft_sequences"] for r in got] == [1, 2, 1]  # row 2 is skipped both times
    said = (done.stdout + done.stderr).count("conversation 2 of ")
    assert said == 1, done.stdout + done.stderr


def test_retrain_explain_warns_with_the_count(tmp_path, monkeypatch, tiny_model):
    from retrain.cli.explain import dry_run as explain
    from tests.run_helpers import write_config

    monkeypatch.chdir(tmp_path)
    chats = [[USER, reply(str(i))] for i in range(6)]
    chats[1], chats[3] = [LONG_USER, reply("5")], [USER, reply(" ")]
    write_rows(tmp_path, chats)
    sft = {"steps": 2, "max_tokens": MAX, "data": {"path": "chat.jsonl"}}
    path = write_config(tmp_path, training={"max_steps": 0}, sft=sft)
    report = explain.build_report(path)
    found = [w for w in report.warnings if w.startswith("sft.data: ")]
    assert found == [f"sft.data: 2 of 6 conversations of {tmp_path / 'chat.jsonl'} can never "
                     "train a token: 1 with a prompt longer than sft.max_tokens = 200 (row 2); "
                     "1 with an empty reply (row 4); the run skips them (fix or drop those "
                     "rows, or raise sft.max_tokens)"]
    assert found[0] in "\n".join(explain.plain_lines(report))
    away = write_config(tmp_path, "away", training={"max_steps": 0}, sft=sft,
                        model={"name": "someone/not-on-this-machine"})
    assert "sft.data: rows not checked against sft.max_tokens: the tokenizer of model.name = " \
        "'someone/not-on-this-machine' is not on this machine yet (the run loads it)" in \
        explain.build_report(away).warnings


def test_a_row_the_template_refuses_is_the_runs_one_line(tmp_path, tok):
    """A template that refuses a system turn (as Gemma's does): explain says what the run says."""
    from retrain.errors import UserError

    write_rows(tmp_path, [[USER, reply("5")], [{"role": "system", "content": "Be brief."},
                                               USER, reply("5")]])
    data = load_sft(SftConfig(data={"path": "chat.jsonl"}, steps=1), tmp_path)
    refusing = Renderer(tok)
    original = tok.chat_template
    tok.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception("
                         "'System role not supported') }}{% endif %}" + original)
    try:
        with pytest.raises(UserError) as err:
            never_trained(data, refusing, MAX)
    finally:
        tok.chat_template = original
    assert str(err.value).startswith(f"sft.data: conversation 2 of {tmp_path / 'chat.jsonl'} "
                                     "cannot be rendered with the model's chat template")
    assert "System role not supported" in str(err.value) and "\n" not in str(err.value)

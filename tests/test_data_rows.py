"""Hostile data rows, for [data] (RL) and [sft.data] alike: a row that gives both a prompt and
messages, a file that starts with a UTF-8 byte order mark, rows numbered from 1, a dataset
folder holding several formats, and an unreadable dataset's cause in its one line."""

from __future__ import annotations

import json

import pytest

from retrain.config.sections import DataConfig
from retrain.config.sft_section import SftConfig
from retrain.environments.sft_data import load_sft
from retrain.environments.tasks import load_task
from retrain.errors import UserError

USER = {"role": "user", "content": "What is 2 + 3?"}
REPLY = {"role": "assistant", "content": "5"}


def rl_rows(folder, name: str) -> None:
    load_task(DataConfig(source="jsonl", path=name, eval_size=0), 0, folder)


def sft_rows(folder, name: str) -> None:
    load_sft(SftConfig(data={"path": name}, steps=1), folder)


@pytest.mark.parametrize("load", [rl_rows, sft_rows], ids=["data", "sft.data"])
@pytest.mark.parametrize("messages", [
    "not a list",                                            # was a traceback
    [{"role": "tool", "content": "42"}, USER, REPLY],        # trained silently
    [{"role": "user", "content": 7}, REPLY],                 # trained silently
    [USER, REPLY],                                           # well-formed, still ambiguous
])
def test_a_row_with_prompt_and_messages_is_one_line(tmp_path, load, messages):
    good = {"prompt": "What is 1 + 1?", "answer": "2"}
    both = {"prompt": "What is 2 + 3?", "answer": "5", "messages": messages}
    (tmp_path / "rows.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(both) + "\n")
    with pytest.raises(UserError) as err:
        load(tmp_path, "rows.jsonl")
    message = str(err.value)
    assert f"{tmp_path / 'rows.jsonl'}:2: give \"prompt\" or \"messages\", not both" in message
    assert "\n" not in message

"""Hostile data rows, for [data] (RL) and [sft.data] alike: a row that gives both a prompt and
messages, a file that starts with a UTF-8 byte order mark, rows numbered from 1, a dataset
folder holding several formats, and an unreadable dataset's cause in its one line."""

from __future__ import annotations

import json

import pytest

from retrain.config.sections import DataConfig
from retrain.config.sft_section import SftConfig
from retrain.environments.sft.data import load_sft
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


@pytest.fixture
def private_hf_cache(tmp_path, monkeypatch):
    """The datasets library's cache in the test's folder (never ~/.cache, never the network)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-home" / "datasets"))


def hf(path: str, **kw) -> DataConfig:
    return DataConfig(source="hf", path=path, eval_size=0, **kw)


ROWS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)]
BOM = b"\xef\xbb\xbf"


@pytest.mark.parametrize("load", [rl_rows, sft_rows], ids=["data", "sft.data"])
def test_a_utf8_byte_order_mark_is_accepted(tmp_path, load):
    (tmp_path / "rows.jsonl").write_bytes(BOM + "".join(json.dumps(r) + "\n"
                                                        for r in ROWS).encode())
    load(tmp_path, "rows.jsonl")
    splits = load_task(DataConfig(source="jsonl", path="rows.jsonl", eval_size=0), 0, tmp_path)
    assert {p.prompt for p in splits.train} == {r["prompt"] for r in ROWS}


def test_utf16_is_named(tmp_path):
    text = "".join(json.dumps(r) + "\n" for r in ROWS)
    (tmp_path / "rows.jsonl").write_bytes(text.encode("utf-16"))
    with pytest.raises(UserError, match=r"data\.path: .*rows\.jsonl is UTF-16 text .*save it as "
                                        "UTF-8"):
        rl_rows(tmp_path, "rows.jsonl")


def test_hf_rows_are_numbered_from_one(tmp_path, private_hf_cache):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", "b", ""], "answer": ["1", "2", "3"]}),
                   tmp_path / "rows.parquet")
    for load in (lambda: load_task(hf("rows.parquet"), 0, tmp_path),
                 lambda: load_sft(SftConfig(data={"source": "hf", "path": "rows.parquet"},
                                            steps=1), tmp_path)):
        with pytest.raises(UserError, match=r"rows\.parquet', row 3: the prompt"):
            load()


def test_an_unreadable_dataset_says_why(tmp_path, private_hf_cache, capfd):
    (tmp_path / "rows.jsonl").write_text(json.dumps(ROWS[0]) + '\n{"prompt": "b", \n')
    with pytest.raises(UserError) as err:
        load_task(hf("rows.jsonl"), 0, tmp_path)
    message = str(err.value)
    assert message.startswith(f"data.path = 'rows.jsonl': {tmp_path / 'rows.jsonl'} cannot be "
                              "read as a dataset: ArrowInvalid: JSON parse error")
    assert "An error occurred while generating the dataset" not in message
    assert "\n" not in message and capfd.readouterr().err == ""  # no second line logged


def test_a_folder_of_several_formats_says_which_files_it_read(tmp_path, private_hf_cache,
                                                              capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "mixed"
    folder.mkdir()
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "answer": ["1", "2", "3"]}),
                   folder / "train.parquet")
    (folder / "extra.csv").write_text("prompt,answer\nx,1\n")
    (folder / "more.jsonl").write_text(json.dumps({"prompt": "y", "answer": "2"}) + "\n")
    splits = load_task(hf("mixed"), 0, tmp_path)
    assert sorted(p.prompt for p in splits.train) == ["a", "b", "c"]
    err = capsys.readouterr().err
    assert err == ("warning: data.path = 'mixed': the folder holds data files of several "
                   "formats and `datasets` reads one: it read train.parquet (parquet) and "
                   "ignored extra.csv, more.jsonl; point data.path at one file, or keep one "
                   "format in the folder\n")
    (folder / "extra.csv").unlink()
    (folder / "more.jsonl").unlink()
    load_task(hf("mixed"), 0, tmp_path)
    assert capsys.readouterr().err == ""


def test_a_folder_whose_other_files_name_no_split_says_so(tmp_path, private_hf_cache, capsys):
    """One format, but only train* files make up the train split: the warning names that
    cause, not "several formats"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "shards"
    folder.mkdir()
    for name, prompts in [("train.parquet", ["a", "b"]), ("extra.parquet", ["x"]),
                          ("more.parquet", ["y"])]:
        pq.write_table(pa.table({"prompt": prompts, "answer": ["1"] * len(prompts)}),
                       folder / name)
    splits = load_task(hf("shards"), 0, tmp_path)
    assert sorted(p.prompt for p in splits.train) == ["a", "b"]
    err = capsys.readouterr().err
    assert err == ("warning: data.path = 'shards': only files named for a split (train*, "
                   "test*, validation*) make up the splits once one file is: `datasets` read "
                   "train.parquet (train) and ignored extra.parquet, more.parquet, whose names "
                   "give no split; point data.path at one file, or name each file for its "
                   "split (train-2.parquet, ...)\n")
    assert "several formats" not in err
    (folder / "extra.parquet").rename(folder / "train-2.parquet")
    (folder / "more.parquet").rename(folder / "train-3.parquet")
    assert len(load_task(hf("shards"), 0, tmp_path).train) == 4
    assert capsys.readouterr().err == ""

"""Data sources: Hugging Face datasets on this machine (`source = "hf"`, offline) and chat-form
problems (`{"messages": [...], "answer": ...}`) whose system prompt reaches the model."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from retrain.config.sections import DataConfig
from retrain.environments.chat_problems import opening_messages
from retrain.environments.host import TaskHost
from retrain.environments.tasks import load_task, render_prompt
from retrain.errors import UserError
from tests import warm
from tests.run_helpers import rows, write_config

SYSTEM = "You are a terse calculator."


@pytest.fixture(autouse=True)
def private_hf_cache(tmp_path, monkeypatch):
    """The datasets library's cache in the test's folder (never ~/.cache, never the network)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-home" / "datasets"))


def write_parquet(path, n=12):
    table = pa.table({"question": [f"What is {i} + 1?" for i in range(n)],
                      "solution": [str(i + 1) for i in range(n)],
                      "level": list(range(n))})
    pq.write_table(table, path)
    return path


def chat(i: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What is {i} * 2?"}]


def test_hf_parquet_file_loads_with_named_fields(tmp_path):
    write_parquet(tmp_path / "train.parquet")
    cfg = DataConfig(source="hf", path="train.parquet", prompt_field="question",
                     answer_field="solution", eval_size=3)
    splits = load_task(cfg, seed=1, config_dir=tmp_path)
    assert len(splits.train) == 9 and len(splits.eval) == 3
    every = {p.prompt: p.answer for p in splits.train + splits.eval}
    assert every == {f"What is {i} + 1?": str(i + 1) for i in range(12)}
    assert load_task(cfg, seed=1, config_dir=tmp_path).eval == splits.eval  # seeded


def test_hf_bad_field_lists_the_columns(tmp_path):
    write_parquet(tmp_path / "train.parquet")
    cfg = DataConfig(source="hf", path="train.parquet", prompt_field="question",
                     answer_field="answer", eval_size=3)
    with pytest.raises(UserError) as err:
        load_task(cfg, seed=1, config_dir=tmp_path)
    message = str(err.value)
    assert "data.answer_field = 'answer'" in message
    assert "'question', 'solution', 'level'" in message


def test_hf_saved_dataset_with_messages_keeps_the_system_prompt(tmp_path):
    import datasets

    rows_ = [{"conversation": chat(i), "target": str(2 * i)} for i in range(6)]
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows_)}).save_to_disk(
        str(tmp_path / "saved"))
    cfg = DataConfig(source="hf", path="saved", split="test", messages_field="conversation",
                     answer_field="target", eval_size=1, instruction="Box it.")
    splits = load_task(cfg, seed=0, config_dir=tmp_path)
    assert len(splits.train) == 5
    opened = opening_messages(splits.train[0], cfg)
    assert opened[0] == {"role": "system", "content": SYSTEM}
    assert opened[1]["role"] == "user" and opened[1]["content"].endswith("\nBox it.")
    with pytest.raises(UserError, match="data.split = 'train'.*'test'"):
        load_task(DataConfig(source="hf", path="saved", messages_field="conversation",
                             answer_field="target"), seed=0, config_dir=tmp_path)


def test_hf_unknown_name_is_not_downloaded(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub.constants as hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # as if imported online
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    cfg = DataConfig(source="hf", path="someone/not-in-the-cache", eval_size=0)
    with pytest.raises(UserError, match="not a dataset in the local Hugging Face cache"):
        load_task(cfg, seed=0, config_dir=tmp_path)
    assert datasets.config.HF_HUB_OFFLINE and hub.HF_HUB_OFFLINE


def write_chat_jsonl(path, n=6):
    lines = [json.dumps({"messages": chat(i), "answer": str(2 * i)}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")


def test_chat_jsonl_keeps_the_system_prompt_in_the_rendered_prompt(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    write_chat_jsonl(tmp_path / "chat.jsonl")
    cfg = DataConfig(source="jsonl", path="chat.jsonl", eval_size=2)
    splits = load_task(cfg, seed=0, config_dir=tmp_path)
    problem = splits.train[0]
    assert problem.prompt.startswith("What is ") and problem.meta["messages"][0]["role"] == \
        "system"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    text = tokenizer.decode(render_prompt(tokenizer, problem, cfg))
    assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>")
    assert problem.prompt in text and cfg.instruction in text
    # the rollout's opening (TaskHost) shows the same conversation
    opened = TaskHost(splits.train, cfg, scorer=None).reset([(0, 0)])[0]
    assert opened.messages == opening_messages(problem, cfg)
    assert opened.messages[0]["content"] == SYSTEM
    plain = DataConfig(source="jsonl", path="chat.jsonl", eval_size=2, chat_template=False)
    assert tokenizer.decode(render_prompt(tokenizer, problem, plain)).startswith(SYSTEM)


@pytest.mark.parametrize(("line", "fragment"), [
    ({"messages": [{"role": "user", "content": "Hi"}]}, "missing \"answer\""),
    ({"messages": [{"role": "user"}], "answer": "1"}, "messages[0]"),
    ({"messages": [{"role": "system", "content": "x"}], "answer": "1"}, "end with a non-empty "
                                                                        "user turn"),
])
def test_chat_jsonl_bad_lines_name_the_line(tmp_path, line, fragment):
    (tmp_path / "bad.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.raises(UserError) as err:
        load_task(DataConfig(source="jsonl", path="bad.jsonl", eval_size=0), 0, tmp_path)
    assert "bad.jsonl:1" in str(err.value) and fragment in str(err.value)


def test_chat_jsonl_final_assistant_turn_is_the_answer(tmp_path):
    msgs = chat(3) + [{"role": "assistant", "content": "6"}]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": msgs}) + "\n")
    [problem] = load_task(DataConfig(source="jsonl", path="c.jsonl", eval_size=0), 0,
                          tmp_path).train
    assert problem.answer == "6" and problem.meta["messages"][-1]["role"] == "user"


def test_tiny_run_trains_two_steps_on_an_hf_source(tmp_path, cli_env, python, tiny_model):
    write_parquet(tmp_path / "train.parquet")
    cli_env["HF_HOME"] = str(tmp_path / "hf-home")
    path = write_config(tmp_path, "hfrun", training={"max_steps": 2},
                        data={"source": "hf", "path": "train.parquet", "eval_size": 2,
                              "prompt_field": "question", "answer_field": "solution"})
    done = warm.run([python, "-m", "retrain", path.name], cwd=tmp_path, env=cli_env,
                    capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [r["step"] for r in rows(tmp_path / "logs" / "hfrun")] == [1, 2]


def test_reward_process_imports_this_checkout(tmp_path, monkeypatch):
    """The scorer's child process imports the same `retrain` as its parent (not another
    install), from any working folder: a reward sees this checkout's code."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    import retrain
    from retrain.config.sections import RewardConfig
    from retrain.environments.answers import Problem
    from retrain.environments.scorer import build_scorer

    (tmp_path / "where.py").write_text(
        "import retrain\n\ndef reward(completion, answer):\n"
        f"    return 1.0 if retrain.__file__ == {retrain.__file__!r} else 0.5\n")
    scorer = build_scorer(RewardConfig(type="custom", function="where.py:reward"), tmp_path)
    try:
        assert scorer.score(["x"], [Problem(prompt="p", answer="a")]).rewards == [1.0]
    finally:
        scorer.close()


# ------------------------------------------------- a rewrite that keeps the file's old mtime


def _write_rows(path, answers: list[str]) -> None:
    """Rows "What is i + 1?" -> answers[i], as parquet or csv by the file's suffix."""
    table = pa.table({"question": [f"What is {i} + 1?" for i in range(len(answers))],
                      "solution": answers})
    if path.suffix == ".csv":
        import pyarrow.csv as pcsv

        pcsv.write_csv(table, path)
    else:
        pq.write_table(table, path)


def _rewrite_keeping_mtime(path, answers: list[str]) -> None:
    """What `cp -p`, `rsync -a` or unpacking an archive do: new bytes, the old mtime."""
    before = path.stat()
    _write_rows(path, answers)
    import os

    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_mtime_ns == before.st_mtime_ns


LAYOUTS = {"parquet": ("rows.parquet", "rows.parquet"), "csv": ("rows.csv", "rows.csv"),
           "folder": ("folder", "folder/train.parquet")}


def _hf_rows(tmp_path, layout: str, answers: list[str]):
    path, file = LAYOUTS[layout]
    (tmp_path / file).parent.mkdir(exist_ok=True)
    _write_rows(tmp_path / file, answers)
    cfg = DataConfig(source="hf", path=path, prompt_field="question", answer_field="solution",
                     eval_size=0)
    return cfg, tmp_path / file


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_rewrite_with_the_old_mtime_is_read_as_it_is_now(tmp_path, layout):
    """`datasets` keys its cache by path and mtime: the file said "6", training saw "5"."""
    cfg, file = _hf_rows(tmp_path, layout, ["5", "6", "7"])
    first = {p.prompt: p.answer for p in load_task(cfg, 0, tmp_path).train}
    assert first["What is 0 + 1?"] == "5"
    _rewrite_keeping_mtime(file, ["6", "7", "8"])
    now = {p.prompt: p.answer for p in load_task(cfg, 0, tmp_path).train}
    assert now == {"What is 0 + 1?": "6", "What is 1 + 1?": "7", "What is 2 + 1?": "8"}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_resume_after_a_rewrite_with_the_old_mtime_is_refused(tmp_path, monkeypatch, layout,
                                                                tiny_model):
    """The resume digest is over the rows as they are now: refused naming the data, and a
    --new run trains on the new rows."""
    pytest.importorskip("torch")
    from retrain.config.loader import load_config
    from retrain.run.single import run_single
    from tests.run_helpers import state

    monkeypatch.chdir(tmp_path)
    cfg, file = _hf_rows(tmp_path, layout, [str(i + 1) for i in range(6)])
    path = write_config(tmp_path, training={"max_steps": 1},
                        data={"source": "hf", "path": cfg.path, "eval_size": 0,
                              "prompt_field": "question", "answer_field": "solution"})
    run_dir = tmp_path / "logs" / "run"
    assert run_single(load_config(path, {}), path) == 0
    then = state(run_dir)["extra"]["data_digests"]["data"]
    _rewrite_keeping_mtime(file, [str(i + 2) for i in range(6)])  # the same rows, new answers
    with pytest.raises(UserError) as refused:
        run_single(load_config(path, {"training.max_steps": 2}), path)
    said = str(refused.value)
    assert f"data = {tmp_path / cfg.path}" in said and "the same 6 rows, different content" in \
        said and "--new" in said
    assert [r["step"] for r in rows(run_dir)] == [1]  # nothing was written
    assert run_single(load_config(path, {}), path, new=True) == 0
    now = state(run_dir)["extra"]["data_digests"]["data"]
    assert now["rows"] == 6 and now["sha256"] != then["sha256"]

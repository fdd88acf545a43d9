"""Tasks: generated problems, JSONL files, held-out splits, the data cursor, prompt rendering."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrain.config.sections import DataConfig
from retrain.environments.answers import check_countdown
from retrain.environments.tasks import (
    DataCursor,
    Problem,
    countdown_problem,
    load_task,
    render_prompt,
)
from retrain.errors import UserError


def data(**kw) -> DataConfig:
    return DataConfig(**kw)


# ---------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize("ops", [["+"], ["-"], ["*"], ["+", "-", "*"]])
def test_arithmetic_answers_are_exact(ops):
    splits = load_task(data(digits=2, operations=ops, size=300, eval_size=20), 0, Path("."))
    for p in splits.train + splits.eval:
        a, op, b = p.meta["a"], p.meta["op"], p.meta["b"]
        assert op in ops and 10 <= a <= 99 and 10 <= b <= 99
        assert p.prompt == f"What is {a} {op} {b}?"
        assert int(p.answer) == {"+": a + b, "-": a - b, "*": a * b}[op]


def test_arithmetic_split_sizes_and_disjoint():
    splits = load_task(data(digits=2, size=1000, eval_size=64), 7, Path("."))
    assert len(splits.train) == 1000 and len(splits.eval) == 64
    train = {p.prompt for p in splits.train}
    held = {p.prompt for p in splits.eval}
    assert len(train) == 1000 and len(held) == 64  # distinct problems
    assert not train & held


def test_small_space_gives_every_remaining_problem_once():
    # 1-digit '+' has 100 problems: 64 held out, 36 left for training (not 5000 repeats).
    splits = load_task(data(digits=1, size=5000, eval_size=64), 0, Path("."))
    assert len(splits.eval) == 64 and len(splits.train) == 36
    assert not {p.prompt for p in splits.train} & {p.prompt for p in splits.eval}


def test_eval_size_too_large_is_user_error():
    with pytest.raises(UserError, match="data.eval_size"):
        load_task(data(digits=1, eval_size=100), 0, Path("."))


@pytest.mark.parametrize("source", ["arithmetic", "countdown"])
def test_generation_is_deterministic_per_seed(source):
    cfg = data(source=source, digits=2, size=200, eval_size=16)
    a, b = load_task(cfg, 3, Path(".")), load_task(cfg, 3, Path("."))
    c = load_task(cfg, 4, Path("."))
    assert a == b
    assert a.train != c.train and a.eval != c.eval


@pytest.mark.parametrize("source", ["arithmetic", "countdown"])
def test_eval_split_does_not_depend_on_train_size(source):
    small = load_task(data(source=source, digits=3, size=10, eval_size=16), 5, Path("."))
    big = load_task(data(source=source, digits=3, size=2000, eval_size=16), 5, Path("."))
    assert small.eval == big.eval


def test_no_eval_split():
    splits = load_task(data(eval_size=0, digits=2, size=50), 0, Path("."))
    assert splits.eval == [] and len(splits.train) == 50


# ---------------------------------------------------------------------------- countdown


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_countdown_problems_are_solvable(n):
    splits = load_task(data(source="countdown", countdown_numbers=n, size=200, eval_size=20),
                       1, Path("."))
    for p in splits.train + splits.eval:
        meta = p.meta
        assert meta["checker"] == "countdown" and len(meta["numbers"]) == n
        assert p.answer == str(meta["target"]) and meta["target"] not in meta["numbers"]
        assert check_countdown(f"\\boxed{{{meta['solution']}}}", p) == 1.0
        assert check_countdown(f"\\boxed{{{meta['target']}}}", p) == 0.0


@settings(deadline=None, max_examples=100)
@given(st.integers(0, 2**32), st.integers(2, 6))
def test_countdown_solution_always_checks(seed, n):
    p = countdown_problem(random.Random(seed), n)
    assert check_countdown(f"\\boxed{{{p.meta['solution']}}}", p) == 1.0


def test_countdown_split_disjoint():
    splits = load_task(data(source="countdown", size=500, eval_size=64), 2, Path("."))
    key = lambda p: (tuple(sorted(p.meta["numbers"])), p.meta["target"])  # noqa: E731
    assert not {key(p) for p in splits.train} & {key(p) for p in splits.eval}


# ---------------------------------------------------------------------------- jsonl


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_relative_to_config_dir(tmp_path, monkeypatch):
    rows = [{"prompt": f"q{i}", "answer": i, "level": i % 3} for i in range(20)]
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "p.jsonl", rows)
    monkeypatch.chdir("/")
    splits = load_task(data(source="jsonl", path="data/p.jsonl", eval_size=5), 0, tmp_path)
    assert len(splits.train) == 15 and len(splits.eval) == 5
    everything = {p.prompt: p for p in splits.train + splits.eval}
    assert everything["q7"] == Problem(prompt="q7", answer="7", meta={"level": 1})
    assert [p.prompt for p in splits.train] == sorted(
        (p.prompt for p in splits.train), key=lambda s: int(s[1:]))  # file order kept


def test_jsonl_split_is_seeded_and_dedupes_prompts(tmp_path):
    rows = [{"prompt": f"q{i % 10}", "answer": "a"} for i in range(30)]
    f = write_jsonl(tmp_path / "p.jsonl", rows)
    cfg = data(source="jsonl", path=str(f), eval_size=3)
    a, b = load_task(cfg, 1, tmp_path), load_task(cfg, 1, tmp_path)
    assert a == b
    held = {p.prompt for p in a.eval}
    assert not held & {p.prompt for p in a.train}


@pytest.mark.parametrize("bad, fragment", [
    ('{"prompt": "q", "answer": ', "invalid JSON"),
    ('["q", "a"]', "expected a JSON object"),
    ('{"prompt": "q"}', "missing 'answer'"),
    ('{"answer": "a"}', "missing 'prompt'"),
    ('{"prompt": "", "answer": "a"}', "non-empty string"),
    ('{"prompt": "q", "answer": null}', "string or a number"),
    ('{"prompt": "q", "answer": "a", "checker": "sudoku"}', "unknown \"checker\""),
    ('{"prompt": "q", "answer": "a", "checker": "countdown", "numbers": [1, 2]}', "\"target\""),
])
def test_jsonl_broken_line_names_file_and_line(tmp_path, bad, fragment):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "q1", "answer": "1"}, "", bad])
    with pytest.raises(UserError) as err:
        load_task(data(source="jsonl", path="p.jsonl", eval_size=0), 0, tmp_path)
    msg = str(err.value)
    assert f"{f}:3:" in msg and fragment in msg
    assert '{"prompt": ' in msg or "use one of" in msg  # says what a good line looks like


def test_jsonl_not_utf8(tmp_path):
    (tmp_path / "p.jsonl").write_bytes(b'{"prompt": "q", "answer": "1"}\n\xff\xfe\n')
    with pytest.raises(UserError, match=r"p\.jsonl:2: not UTF-8"):
        load_task(data(source="jsonl", path="p.jsonl", eval_size=0), 0, tmp_path)


@pytest.mark.parametrize("setup, fragment", [
    (lambda d: None, "does not exist"),
    (lambda d: (d / "p.jsonl").mkdir(), "is a folder"),
    (lambda d: (d / "p.jsonl").write_text("\n\n"), "no problems"),
    (lambda d: write_jsonl(d / "p.jsonl", [{"prompt": "q", "answer": "a"}] * 2), "eval_size"),
])
def test_jsonl_file_problems(tmp_path, setup, fragment):
    setup(tmp_path)
    with pytest.raises(UserError, match=fragment):
        load_task(data(source="jsonl", path="p.jsonl", eval_size=2), 0, tmp_path)


def test_jsonl_countdown_checker_from_file(tmp_path):
    row = {"prompt": "make 10", "answer": "10", "checker": "countdown", "numbers": [2, 5],
           "target": 10}
    write_jsonl(tmp_path / "p.jsonl", [row])
    (p,) = load_task(data(source="jsonl", path="p.jsonl", eval_size=0), 0, tmp_path).train
    assert check_countdown("\\boxed{2 * 5}", p) == 1.0


# ---------------------------------------------------------------------------- cursor


def test_cursor_covers_each_epoch_once_and_reshuffles():
    c = DataCursor(10, seed=1, shuffle=True)
    e0, e1 = c.take(10), c.take(10)
    assert sorted(e0) == sorted(e1) == list(range(10))
    assert e0 != e1 and c.epoch == 2 and c.position == 0


def test_cursor_without_shuffle_is_in_order():
    c = DataCursor(5, seed=1, shuffle=False)
    assert c.take(7) == [0, 1, 2, 3, 4, 0, 1]
    assert (c.epoch, c.position) == (1, 2)


def test_cursor_seed_changes_order():
    assert DataCursor(50, 1, True).take(50) != DataCursor(50, 2, True).take(50)


@settings(deadline=None, max_examples=100)
@given(n=st.integers(1, 30), seed=st.integers(0, 1000), shuffle=st.booleans(),
       takes=st.lists(st.integers(0, 40), min_size=1, max_size=8), split=st.integers(0, 8))
def test_cursor_resume_equals_straight_run(n, seed, shuffle, takes, split):
    straight = DataCursor(n, seed, shuffle)
    expected = [straight.take(k) for k in takes]
    first = DataCursor(n, seed, shuffle)
    got = [first.take(k) for k in takes[:split]]
    state = json.loads(json.dumps(first.state_dict()))  # it goes through state.json
    resumed = DataCursor(n, seed, shuffle)
    resumed.load_state_dict(state)
    got += [resumed.take(k) for k in takes[split:]]
    assert got == expected
    assert resumed.state_dict() == straight.state_dict()


def test_cursor_resume_with_changed_data_is_user_error():
    c = DataCursor(10, 0, True)
    c.take(3)
    other = DataCursor(11, 0, True)
    with pytest.raises(UserError, match="--new"):
        other.load_state_dict(c.state_dict())


def test_cursor_rejects_empty():
    with pytest.raises(ValueError):
        DataCursor(0, 0, True)


# ---------------------------------------------------------------------------- prompts


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def test_render_prompt_uses_chat_template(tokenizer):
    p = Problem(prompt="What is 7 + 5?", answer="12", meta={})
    cfg = data()
    ids = render_prompt(tokenizer, p, cfg)
    assert all(isinstance(i, int) for i in ids)
    text = tokenizer.decode(ids)
    assert text == ("<|im_start|>user\nWhat is 7 + 5?\nEnd your reply with the result written as "
                    "\\boxed{result}, e.g. 3 + 4 = 7, so \\boxed{7}."
                    "<|im_end|>\n<|im_start|>assistant\n")


def test_render_prompt_plain_text(tokenizer):
    p = Problem(prompt="What is 7 + 5?", answer="12", meta={})
    ids = render_prompt(tokenizer, p, data(chat_template=False, instruction="Be brief."))
    assert tokenizer.decode(ids) == "What is 7 + 5?\nBe brief."
    assert ids == tokenizer("What is 7 + 5?\nBe brief.")["input_ids"]


def test_render_prompt_without_template_falls_back(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", None)
    p = Problem(prompt="Hi", answer="", meta={})
    assert tokenizer.decode(render_prompt(tokenizer, p, data(instruction=""))) == "Hi"

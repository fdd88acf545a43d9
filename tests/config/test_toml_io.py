"""TOML writer: every value a config can hold is written so that tomllib reads it back equal."""

from __future__ import annotations

import tomllib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrain.config import toml_io

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=10)
_key = st.one_of(st.from_regex(r"[A-Za-z0-9_-]{1,8}", fullmatch=True), _text)
_scalar = st.one_of(st.booleans(), st.integers(-2**63, 2**63 - 1),
                    st.floats(allow_nan=False), _text)
_value = st.recursive(
    _scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_key, inner, max_size=4)),
    max_leaves=15)
_doc = st.dictionaries(_key, _value, max_size=5)


@settings(max_examples=300, deadline=None)
@given(_doc)
def test_dumps_loads_round_trip(doc):
    text = toml_io.dumps(doc)
    assert tomllib.loads(text) == doc


@given(_text)
def test_strings_and_keys_round_trip(s):
    assert tomllib.loads(f"v = {toml_io.format_string(s)}")["v"] == s
    assert tomllib.loads(f"{toml_io.format_key(s)} = 1") == {s: 1}


@pytest.mark.parametrize("text", ["a\x7fb", "tab\there", "nl\nx", 'q"uote', "back\\slash",
                                  "\x00\x1f", "é ü 字 🙂"])
def test_control_characters_are_escaped(text):
    written = toml_io.format_string(text)
    assert "\x7f" not in written and "\n" not in written
    assert tomllib.loads(f"v = {written}")["v"] == text


def test_keys_quoted_only_when_needed():
    assert toml_io.format_key("batch_size") == "batch_size"
    assert toml_io.format_key("training.lr") == '"training.lr"'
    assert toml_io.format_key("") == '""'


def test_special_floats():
    assert toml_io.format_value(float("inf")) == "inf"
    assert toml_io.format_value(-float("inf")) == "-inf"
    assert toml_io.format_value(1e-05) == "1e-05"
    assert tomllib.loads("v = " + toml_io.format_value(1e300))["v"] == 1e300


def test_tables_arrays_of_tables_and_empty_tables():
    doc = {"a": {"x": 1, "sub": {}, "rows": [{"k": 1}, {}]}, "b": {}, "c": [{"d": {"e": [1]}}]}
    assert tomllib.loads(toml_io.dumps(doc)) == doc


def test_is_tomlable_rejects_what_toml_cannot_hold():
    assert toml_io.is_tomlable({"a": [1, "x", {"b": None is None}]})
    assert not toml_io.is_tomlable(None)
    assert not toml_io.is_tomlable({1: "int key"})
    assert not toml_io.is_tomlable("lone \udcff surrogate")
    with pytest.raises(TypeError):
        toml_io.format_value(object())


def test_key_with_trailing_newline_is_quoted():
    # found by hypothesis: `$` in a regex matches before a final newline
    assert toml_io.format_key("0\n") == '"0\\n"'
    assert tomllib.loads(toml_io.dumps({"t": {"0\n": 1}})) == {"t": {"0\n": 1}}

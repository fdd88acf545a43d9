"""Stop strings end a row while it decodes: exactly where cutting the unstopped completion
afterwards would, with the same tokens and log-probs, the other rows untouched, and the
stopped rows out of the batch."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrain.backends.base import Completion
from retrain.backends.stop_strings import (
    StopScan,
    StopWatch,
    cut_at_stop_strings,
    first_stop,
    first_stop_end,
    stop_prefix_len,
)
from retrain.config.sections import ConfigError, from_dict


def _utf8(tokens: list[int]) -> str:
    """A byte-level tokenizer's decode: token = byte."""
    return bytes(tokens).decode("utf-8", errors="replace")


def test_the_watch_fires_on_the_token_the_whole_text_search_finds():
    rng = random.Random(3)
    alphabet = ["a", "b", "\n", "é", "€", "😀"]  # multi-byte: the window starts mid-character
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        tokens = list(text.encode())
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
                 for _ in range(rng.randint(1, 2))]
        watch = StopWatch(stops, _utf8)
        first = next((n for n in range(1, len(tokens) + 1) if watch.hit(tokens[:n])), None)
        assert first == first_stop_end(tokens, stops, _utf8), (text, stops)


def test_no_stop_strings_means_no_watch():
    assert not StopWatch([], _utf8) and not StopWatch([""], _utf8)
    c = Completion([1, 2], [-1.0, -2.0], "length")
    assert cut_at_stop_strings(c, [""], _utf8) is c


ALPHABET = "ab<\ufffd€"  # few letters: stop strings overlap and repeat; U+FFFD as decoders send it
_stops = st.lists(st.text(ALPHABET, min_size=1, max_size=6), max_size=3)
# One step of a growing text: keep `back` fewer characters of it (a decoder rewriting its
# end, or further back), then append `more`.
_steps = st.lists(st.tuples(st.integers(0, 12), st.text(ALPHABET, max_size=5)), max_size=40)


@settings(max_examples=400, deadline=None)
@given(_stops, _steps)
def test_the_incremental_scan_answers_as_the_whole_text_does(stops, steps):
    scan, text = StopScan(stops), ""
    for back, more in steps:
        back = back if back > StopScan.LAG else 0  # mostly appends, sometimes a rewrite
        text = text[:max(0, len(text) - back)] + more
        assert scan.scan(text) == (first_stop(text, stops), stop_prefix_len(text, stops)), \
            (text, stops)


class _Counted(str):
    """Text that counts the characters a stop check steps through: each character read,
    what `endswith` compares, what `find` searches."""

    steps = 0

    def __getitem__(self, i):
        if isinstance(i, int):
            _Counted.steps += 1
        return str.__getitem__(self, i)

    def endswith(self, suffix, *args):
        _Counted.steps += len(suffix)
        return str.endswith(self, suffix, *args)

    def find(self, sub, *args):
        _Counted.steps += len(self)
        return str.find(self, sub, *args)


def test_a_streamed_choice_checks_only_its_new_text_for_stop_strings():
    """A 4,000-character stop string and a 3,000-character reply: every token costs the
    stream's stop check the new text plus a short tail (StopScan.LAG), not the whole text
    or the stop string's length (before: about 8 million character steps a token)."""
    from retrain.serve.openai.reply import TextStream, Tokens

    stop = "x" * 3999 + "!"
    tok = Tokens(decode=lambda ids: _Counted("".join("x" if i == 1 else "a" for i in ids)),
                 piece=lambda i: "x" if i == 1 else "a", end_ids=frozenset())
    stream = TextStream(tok, (stop,))
    worst = 0
    for n in range(3000):
        _Counted.steps = 0
        sent = stream.push(n % 2)
        worst = max(worst, _Counted.steps)
        # an "x" may begin the stop string: it is sent with the "a" after it
        assert sent == ("" if n % 2 else "xa" if n else "a")
    assert worst <= 1 + StopScan.LAG + 1, worst  # the new character, the tail, U+FFFD's look


def test_training_stop_is_a_list_of_strings():
    assert from_dict({"training": {"stop": ["\n\nUser:"]}}).training.stop == ["\n\nUser:"]
    assert from_dict({}).training.stop == []
    with pytest.raises(ConfigError, match="training.stop"):
        from_dict({"training": {"stop": "\n"}})


torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from retrain.backends.base import SamplingParams  # noqa: E402
from retrain.backends.local.backend import LocalBackend  # noqa: E402


@pytest.fixture
def backend(model):
    b = LocalBackend.new_adapter(model, "stops", lora_rank=4, seed=3)
    yield b
    b.close()
    model.delete_adapter("stops")


PROMPTS = [[1, 5, 9, 13], [1, 7], [1, 3, 3, 3, 3, 3, 8]]


class _RowsDecoded:
    """Counts the rows each forward pass of the model runs (prefill included)."""

    def __init__(self, model):
        self.rows = 0
        self.handle = model.base.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, _module, _args, kwargs):
        self.rows += int(kwargs["input_ids"].shape[0])


def _stop_from(groups, decode) -> str:
    """Text of a few tokens from the middle of the longest completion: it must stop there."""
    longest = max((c.tokens for g in groups for c in g), key=len)
    assert len(longest) >= 10, "completions too short to pick a stop string from"
    for start in range(5, len(longest) - 1):  # whole characters (no U+FFFD of a cut one)
        text = decode(longest[start:start + 2])
        if text and "\ufffd" not in text:
            return text
    raise AssertionError("no whole-character text in the longest completion")


@pytest.mark.parametrize("temperature,per_prompt", [(1.0, False), (1.0, True), (0.0, False)])
def test_stop_strings_cut_rows_as_cutting_afterwards_would(model, backend, temperature,
                                                           per_prompt):
    decode = model.tokenizer.decode
    seeds = (11, 12, 13) if per_prompt else None
    base = SamplingParams(max_tokens=24, temperature=temperature, seed=5, prompt_seeds=seeds)
    counter = _RowsDecoded(model)
    try:
        free = backend.sample(PROMPTS, 4, base)
        free_rows, counter.rows = counter.rows, 0
        stops = (_stop_from(free, decode), "\x00never\x00")
        params = SamplingParams(max_tokens=24, temperature=temperature, seed=5,
                                stop_strings=stops, prompt_seeds=seeds)
        stopped = backend.sample(PROMPTS, 4, params)
        stopped_rows = counter.rows
        again = backend.sample(PROMPTS, 4, params)
    finally:
        counter.handle.remove()
    cut = 0
    for g_free, g_stop, g_again in zip(free, stopped, again, strict=True):
        for a, b, c in zip(g_free, g_stop, g_again, strict=True):
            want = cut_at_stop_strings(a, stops, decode)
            assert b.tokens == want.tokens and b.finish_reason == want.finish_reason
            assert max((abs(x - y) for x, y in zip(b.logprobs, want.logprobs, strict=True)),
                       default=0.0) < 1e-5
            assert c.tokens == b.tokens  # seeded: reproducible (log-probs to float noise)
            assert c.logprobs == pytest.approx(b.logprobs, abs=1e-5)
            cut += len(b.tokens) < len(a.tokens)
    assert cut >= 1
    assert stopped_rows < free_rows  # the stopped rows left the batch


def test_stop_tokens_end_rows_like_eos(model, backend):
    free = backend.sample(PROMPTS, 3, SamplingParams(max_tokens=16, seed=2))
    tok = free[0][0].tokens[3]
    stopped = backend.sample(PROMPTS, 3, SamplingParams(max_tokens=16, seed=2,
                                                        stop_tokens=(tok,)))
    for g_free, g_stop in zip(free, stopped, strict=True):
        for a, b in zip(g_free, g_stop, strict=True):
            end = a.tokens.index(tok) + 1 if tok in a.tokens else len(a.tokens)
            assert b.tokens == a.tokens[:end]
            if tok in a.tokens:
                assert b.finish_reason == "stop"

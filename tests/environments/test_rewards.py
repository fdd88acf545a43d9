"""Rewards: boxed extraction, match/math/format/custom scoring, failures and deadlines."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrain.config.sections import RewardConfig
from retrain.environments.answers import (
    CHECKERS,
    answers_match,
    check_countdown,
    extract_answer,
    match_reward,
    math_reward,
)
from retrain.environments.scorer import build_scorer
from retrain.environments.tasks import Problem
from retrain.errors import UserError

P5 = Problem(prompt="What is 2 + 3?", answer="5", meta={})


def scorer(tmp_path: Path | None = None, **kw):
    return build_scorer(RewardConfig(**kw), tmp_path or Path("."))


# ---------------------------------------------------------------------------- extraction


@pytest.mark.parametrize("text, expected", [
    ("The answer is \\boxed{5}.", "5"),
    ("\\boxed{1} then \\boxed{2}", "2"),  # the last box wins
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
    ("\\boxed{{a}{b{c}}}", "{a}{b{c}}"),
    ("\\boxed {7}", "7"),  # space before the brace
    ("\\boxed{}", ""),
    ("\\boxed{3} and then \\boxed{4", "3"),  # an unclosed (cut-off) box is skipped
    ("\\boxed{\\boxed{9}}", "9"),  # the box that starts last
    ("no box here: 5", None),
    ("\\boxed{unclosed", None),
    ("", None),
    ("}{ \\boxed{x} }", "x"),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@settings(deadline=None, max_examples=200)
@given(st.lists(st.sampled_from(["\\boxed{", "{", "}", "1", "x", " ", "\\"]), max_size=30)
       .map("".join))
def test_extract_answer_returns_a_balanced_box_content(text):
    out = extract_answer(text)
    if out is None:
        return
    assert "\\boxed{" + out + "}" in text
    depth = 0
    for c in out:  # the content's own braces are balanced and never close the box early
        depth += {"{": 1, "}": -1}.get(c, 0)
        assert depth >= 0
    assert depth == 0


def test_extract_answer_is_linear_on_many_boxes():
    text = "\\boxed{" * 20000 + "1" + "}" * 20000
    start = time.perf_counter()
    assert extract_answer(text) == "1"
    assert time.perf_counter() - start < 1.0


# ---------------------------------------------------------------------------- match


@pytest.mark.parametrize("pred, ref", [
    ("5", "5"), (" 5 ", "5"), ("$5$", "5"), ("5.", "5"), ("5.0", "5"), ("5", "5.00"),
    ("1,000", "1000"), ("1000", "1,000"), ("-3", "\u22123"), ("+4", "4"),
    ("\\frac{1}{2}", "1/2"), ("\\dfrac{1}{2}", "0.5"), ("x = 5", "5"), ("\\text{5}", "5"),
    ("12", "\\boxed{12}"), ("12", "The answer is \\boxed{12}."), ("abc", "abc"),
])
def test_answers_match(pred, ref):
    assert answers_match(pred, ref)


@pytest.mark.parametrize("pred, ref", [
    ("6", "5"), ("5", "50"), ("1,00", "100"), ("0.333", "1/3"), ("", "5"), ("5", ""),
    ("abc", "abd"), ("1e999999", "1"),
])
def test_answers_differ(pred, ref):
    assert not answers_match(pred, ref)


def test_unboxed_completion_never_matches_unboxed_reference():
    # The old tool took the reference's (missing) box as "" and matched unboxed text to it.
    for ref in ("5", "", "  ", "no box in this reference"):
        for text in ("", "5", "the answer is 5", "no box in this reference"):
            assert match_reward(text, ref) == 0.0


def test_empty_box_is_not_correct():
    assert match_reward("\\boxed{}", "") == 0.0
    assert match_reward("\\boxed{ }", " ") == 0.0


def test_match_scorer_rewards_and_correct():
    s = scorer()
    texts = ["so \\boxed{5}", "\\boxed{6}", "5", "\\boxed{5.0}"]
    out = s.score(texts, [P5] * 4)
    assert out.rewards == [1.0, 0.0, 0.0, 1.0]
    assert out.correct == [True, False, False, True]
    assert out.failures == 0


# ---------------------------------------------------------------------------- math


@pytest.mark.parametrize("pred, ref, expected", [
    ("\\frac{1}{2}", "0.5", 1.0),
    ("2/4", "\\frac{1}{2}", 1.0),
    ("\\sqrt{4}", "2", 1.0),
    ("3", "2", 0.0),
])
def test_math_reward(pred, ref, expected):
    assert math_reward(f"\\boxed{{{pred}}}", ref) == expected


def test_math_reward_needs_a_box():
    assert math_reward("the answer is 2", "2") == 0.0


def test_math_fallback_without_math_verify(monkeypatch):
    import retrain.environments.answers as rw

    monkeypatch.setattr(rw, "_MV", [None])
    assert math_reward("\\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert math_reward("\\boxed{0.50000001}", "0.5") == 1.0  # numeric closeness
    assert math_reward("\\boxed{\\sqrt{4}}", "2") == 0.0  # needs math-verify


def test_math_scorer_in_worker_process():
    s = scorer(type="math")
    out = s.score(["\\boxed{\\frac{10}{2}}", "\\boxed{4}"], [P5, P5])
    assert out.rewards == [1.0, 0.0] and out.correct == [True, False] and out.failures == 0


# ---------------------------------------------------------------------------- format


def test_format_reward_and_correctness():
    s = scorer(type="format", pattern=r"\\boxed\{.+\}")
    out = s.score(["\\boxed{6}", "nothing", "\\boxed{5}"], [P5] * 3)
    assert out.rewards == [1.0, 0.0, 1.0]
    assert out.correct == [False, False, True]  # correctness still means the right answer


def test_format_bad_regex_is_user_error():
    with pytest.raises(UserError, match="reward.pattern"):
        scorer(type="format", pattern="(")


# ---------------------------------------------------------------------------- countdown


def countdown(numbers, target):
    return Problem(prompt="", answer=str(target),
                   meta={"checker": "countdown", "numbers": numbers, "target": target})


@pytest.mark.parametrize("box, expected", [
    ("(3 + 7) * 12", 1.0), ("12*(7+3)", 1.0), ("12 \\times (3 + 7)", 1.0),
    ("(3 + 7) * 12 = 120", 1.0), ("(3 + 7) * 12 = 121", 0.0),
    ("3 * 7 * 12", 0.0),  # wrong value
    ("(3 + 3) * 20", 0.0),  # 3 twice, 20 not given
    ("120", 0.0),  # the target alone uses no numbers
    ("(3 + 7) * 12.0", 0.0), ("-3 + 123", 0.0), ("__import__('os')", 0.0),
    ("(3 + 7) ** 12", 0.0), ("(3 + 7) / 12", 0.0), ("", 0.0), ("(" * 300 + "3" + ")" * 300, 0.0),
])
def test_countdown_checker(box, expected):
    assert check_countdown(f"\\boxed{{{box}}}", countdown([3, 7, 12], 120)) == expected


def test_countdown_repeated_numbers_allowed_when_given_twice():
    assert check_countdown("\\boxed{5 * 5 - 1}", countdown([5, 5, 1], 24)) == 1.0
    assert check_countdown("\\boxed{5 * 5 - 1}", countdown([5, 2, 1], 24)) == 0.0


def test_countdown_goes_through_match_and_math_scorers():
    p = countdown([3, 7, 12], 120)
    for kind in ("match", "math"):
        out = scorer(type=kind).score(["\\boxed{(3 + 7) * 12}", "\\boxed{120}"], [p, p])
        assert out.rewards == [1.0, 0.0], kind
    assert set(CHECKERS) == {"countdown"}


# ---------------------------------------------------------------------------- custom


def write(path: Path, code: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(code))
    return path


def test_custom_from_file_path_relative_to_config_dir(tmp_path, monkeypatch):
    write(tmp_path / "plugins" / "my_rewards.py", """
        from helper import bonus  # a sibling module, importable without PYTHONPATH

        def score(completion, answer, scale=1.0):
            return scale * (answer in completion) + bonus()
    """)
    write(tmp_path / "plugins" / "helper.py", "def bonus():\n    return 0.0\n")
    monkeypatch.chdir("/")
    s = scorer(tmp_path, type="custom", function="plugins/my_rewards.py:score",
               params={"scale": 0.5})
    out = s.score(["it is 5", "it is 6"], [P5, P5])
    assert out.rewards == [0.5, 0.0] and out.failures == 0
    assert out.correct == [False, False]  # no boxed answer, so not correct


def test_custom_from_module_name_relative_to_config_dir(tmp_path, monkeypatch):
    write(tmp_path / "cfgrewards_pkg" / "__init__.py", "")
    write(tmp_path / "cfgrewards_pkg" / "scoring.py", """
        def exact(completion, answer):
            return completion.strip() == answer
    """)
    monkeypatch.chdir("/")
    monkeypatch.delitem(sys.modules, "cfgrewards_pkg", raising=False)
    before = list(sys.path)
    s = scorer(tmp_path, type="custom", function="cfgrewards_pkg.scoring:exact")
    assert sys.path == before  # the config folder was only on sys.path for the import
    out = s.score(["5", "\\boxed{5}"], [P5, P5])
    assert out.rewards == [1.0, 0.0]  # a bool return is accepted
    assert out.correct == [False, True]


def test_custom_absolute_path(tmp_path):
    f = write(tmp_path / "abs_reward.py", "def r(c, a):\n    return 1\n")
    s = scorer(Path("/nonexistent"), type="custom", function=f"{f}:r")
    assert s.score(["x"], [P5]).rewards == [1.0]


@pytest.mark.parametrize("function, fragment", [
    ("no_such_module_xyz:fn", "no module 'no_such_module_xyz'"),
    ("missing.py:fn", "no file"),
    ("rewards_ok.py:nope", "has no function 'nope'"),
    ("rewards_ok.py:VALUE", "not a function"),
    ("rewards_broken.py:fn", "SyntaxError"),
    ("rewards_dep.py:fn", "No module named 'not_installed_dep_xyz'"),
    ("rewards_ok.py", "module:function"),
    ("rewards_ok.py:two_args_only", "cannot be called"),
])
def test_custom_errors_name_the_key(tmp_path, function, fragment):
    write(tmp_path / "rewards_ok.py", """
        VALUE = 3
        def fn(completion, answer):
            return 1.0
        def two_args_only(completion, answer):
            return 1.0
    """)
    write(tmp_path / "rewards_broken.py", "def fn(:\n")
    write(tmp_path / "rewards_dep.py", "import not_installed_dep_xyz\n")
    params = {"k": 1} if function.endswith("two_args_only") else {}
    with pytest.raises(UserError) as err:
        scorer(tmp_path, type="custom", function=function, params=params)
    assert "reward.function" in str(err.value)
    assert fragment in str(err.value)


def test_custom_that_raises_or_returns_junk_counts_failures(tmp_path):
    write(tmp_path / "bad.py", """
        def fn(completion, answer):
            if completion == "raise":
                raise RuntimeError("boom")
            if completion == "exit":
                raise SystemExit(3)
            if completion == "nan":
                return float("nan")
            if completion == "str":
                return "1"
            return 0.25
    """)
    s = scorer(tmp_path, type="custom", function="bad.py:fn")
    out = s.score(["raise", "ok", "exit", "nan", "str"], [P5] * 5)
    assert out.rewards == [0.0, 0.25, 0.0, 0.0, 0.0]
    assert out.failures == 4
    assert "RuntimeError: boom" in out.errors[0]
    assert len(out.errors) == 4


def test_custom_that_hangs_times_out_and_scoring_continues(tmp_path):
    write(tmp_path / "slow.py", """
        import time
        def fn(completion, answer):
            if completion == "hang":
                time.sleep(30)
            return 1.0
    """)
    s = scorer(tmp_path, type="custom", function="slow.py:fn", timeout_s=0.2)
    start = time.perf_counter()
    out = s.score(["ok", "hang", "ok", "hang", "ok"], [P5] * 5)
    assert time.perf_counter() - start < 10.0  # not 2 x 30 s
    assert out.rewards == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert out.failures == 2
    assert "timed out" in out.errors[0]
    assert s.score(["ok"], [P5]).rewards == [1.0]  # a fresh worker took over


def test_score_length_mismatch_is_a_bug():
    with pytest.raises(ValueError):
        scorer().score(["a"], [])


def test_huge_numbers_do_not_break_matching():
    big = "9" * 5000
    assert match_reward(f"\\boxed{{{big}}}", big) == 1.0  # equal text, no int() needed
    assert match_reward(f"\\boxed{{{big}}}", "9") == 0.0


def test_scorer_process_stops_when_closed():
    s = scorer()
    s.score(["\\boxed{5}"], [P5])
    proc = s._worker.proc
    s.close()
    assert proc.poll() is not None


def test_math_blowup_holding_the_gil_is_killed_not_waited_for():
    # sympy expands 9^(9^9) in C without releasing the GIL: a thread deadline cannot stop it.
    s = scorer(type="math", timeout_s=1.0)
    start = time.perf_counter()
    out = s.score(["\\boxed{9^{9^{9}}}", "\\boxed{5}"], [P5, P5])
    assert out.rewards == [0.0, 1.0] and out.failures == 1
    assert "timed out" in out.errors[0]
    assert time.perf_counter() - start < 30


def test_custom_that_exits_or_prints_does_not_break_scoring(tmp_path):
    write(tmp_path / "rude.py", """
        import os
        def fn(completion, answer):
            print("noise on stdout")
            if completion == "die":
                os._exit(3)
            if completion == "bigint":
                return 10 ** 10 ** 10  # C code holding the GIL for minutes
            return 1.0
    """)
    s = scorer(tmp_path, type="custom", function="rude.py:fn", timeout_s=1.0)
    out = s.score(["ok", "die", "ok", "bigint", "ok"], [P5] * 5)
    assert out.rewards == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert out.failures == 2
    assert "died" in out.errors[0] and "timed out" in out.errors[1]


def test_custom_module_imported_in_the_worker_only(tmp_path):
    marker = tmp_path / "imported"
    write(tmp_path / "once.py", f"""
        from pathlib import Path
        p = Path({str(marker)!r})
        p.write_text(p.read_text() + "x" if p.exists() else "x")
        def fn(completion, answer):
            return 1.0
    """)
    s = scorer(tmp_path, type="custom", function="once.py:fn")
    assert s.score(["a"], [P5]).rewards == [1.0]
    assert marker.read_text() == "x"  # a heavy module (a reward model) loads once


def _kill_and_reap(proc) -> None:
    """SIGKILL a worker from outside while it waits for a request (the OOM killer)."""
    import signal

    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


def test_a_worker_killed_between_calls_is_replaced_and_scores_the_completion(capsys):
    s = scorer()
    assert s.score(["\\boxed{5}"], [P5]).rewards == [1.0]
    _kill_and_reap(s._worker.proc)
    out = s.score(["\\boxed{5}", "\\boxed{4}"], [P5, P5])
    assert out.rewards == [1.0, 0.0] and out.failures == 0
    err = capsys.readouterr().err
    assert "reward worker process died between calls (killed by SIGKILL" in err
    s.close()


def test_the_worker_imports_this_very_retrain(tmp_path, monkeypatch):
    """Not an installed copy (an editable install of another checkout): the child puts the
    folder holding this `retrain` package first on its path. (Where retrain is installed from
    this very checkout, the test cannot tell.)"""
    import retrain

    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(tmp_path)  # not the checkout's folder, which `python -c` would search
    marker = tmp_path / "where.txt"
    write(tmp_path / "where.py", f"""
        from pathlib import Path
        import retrain
        def fn(completion, answer):
            Path({str(marker)!r}).write_text(retrain.__file__)
            return 1.0
    """)
    s = scorer(tmp_path, type="custom", function="where.py:fn")
    assert s.score(["a"], [P5]).rewards == [1.0]
    s.close()
    assert Path(marker.read_text()).resolve() == Path(retrain.__file__).resolve()

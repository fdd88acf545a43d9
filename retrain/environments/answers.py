"""Answer checking: what a completion answers, and whether it matches the reference.

Pure functions, no I/O. `match` compares the last \\boxed{} answer with the reference
(normalized text or equal numbers); `math` also asks math-verify when it is installed.
Task-specific checks plug in through `Problem.meta["checker"]`, a name in `CHECKERS`
(built in: "countdown"); such a problem is scored by its checker instead of its answer.
"""

from __future__ import annotations

import ast
import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

CORRECT_AT = 1 - 1e-9  # a reward at or above this counts as correct


@dataclass
class Problem:
    """One prompt and its reference answer; `meta` carries what a task-specific check needs."""

    prompt: str
    answer: str
    meta: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------- answer extraction

_BOX = re.compile(r"\\boxed\s*\{")
_BRACE = re.compile(r"[{}]")


def extract_answer(text: str) -> str | None:
    """The content of the last complete \\boxed{...} in `text` (nested braces ok), else None."""
    starts = {m.end() for m in _BOX.finditer(text)}
    if not starts:
        return None
    found: tuple[int, int] | None = None
    stack: list[int] = []  # content start of each open brace; -1 when it opens no box
    for m in _BRACE.finditer(text, min(starts) - 1):
        if m.group() == "{":
            stack.append(m.end() if m.end() in starts else -1)
        elif stack:
            start = stack.pop()
            if start >= 0 and (found is None or start > found[0]):
                found = (start, m.start())
    return None if found is None else text[found[0]: found[1]]


def reference_answer(reference: str) -> str:
    """What a reference means: its boxed content if it has a box, else the whole string."""
    boxed = extract_answer(reference) if "\\boxed" in reference else None
    return reference if boxed is None else boxed


_TEXT_WRAP = re.compile(r"\\(?:text|mathrm|textbf|mathbf)\{([^{}]*)\}")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
_DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE]([+-]?\d+))?")
_FRAC = re.compile(r"([+-]?)\\frac\{([+-]?\d+)\}\{([+-]?\d+)\}|([+-]?\d+)/([+-]?\d+)")


def normalize(answer: str) -> str:
    """Drop what does not change an answer: spaces, $, trailing '.', thousands commas."""
    s = _TEXT_WRAP.sub(r"\1", answer)
    for old, new in (("\u2212", "-"), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                     ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\left", ""), ("\\right", ""),
                     ("$", "")):
        s = s.replace(old, new)
    s = "".join(s.split()).rstrip(".")
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    return s


def as_number(s: str) -> Fraction | None:
    """The exact value of a normalized plain number, fraction or \\frac{a}{b}; else None."""
    if len(s) > 1000:  # int() refuses over 4300 digits; no real answer is this long
        return None
    m = _DECIMAL.fullmatch(s)
    if m:
        if m.group(1) and abs(int(m.group(1))) > 400:  # keep Fraction from building huge ints
            return None
        return Fraction(s)
    m = _FRAC.fullmatch(s)
    if m:
        sign, num, den = (m.group(1), m.group(2), m.group(3)) if m.group(2) else \
            ("", m.group(4), m.group(5))
        if int(den) != 0:
            value = Fraction(int(num), int(den))
            return -value if sign == "-" else value
    return None


def answers_match(predicted: str, reference: str) -> bool:
    """Whether a boxed answer equals the reference (normalized text or equal numbers)."""
    p, r = normalize(predicted), normalize(reference_answer(reference))
    if not p or not r:
        return False
    if p == r:
        return True
    np_, nr = as_number(p), as_number(r)
    if np_ is not None and nr is not None:
        return np_ == nr
    if "=" in p and "=" not in r:  # "x = 5" answers "5"
        return answers_match(p.rsplit("=", 1)[1], r)
    return False


def match_reward(text: str, reference: str) -> float:
    """1 when the last boxed answer in `text` equals the reference, else 0 (no box: 0)."""
    predicted = extract_answer(text)
    return 1.0 if predicted is not None and answers_match(predicted, reference) else 0.0


# ---------------------------------------------------------------------------- math


def math_reward(text: str, reference: str) -> float:
    """1 when the boxed answer is mathematically equal to the reference (math-verify if any)."""
    predicted = extract_answer(text)
    if predicted is None:
        return 0.0
    if answers_match(predicted, reference):
        return 1.0
    mv = load_math_verify()
    if mv is None:
        return 1.0 if _numbers_close(predicted, reference) else 0.0
    gold_text = reference_answer(reference)
    if not normalize(gold_text):
        return 0.0
    # Timeouts off: math-verify's own use signal.alarm, which raises off the main thread;
    # the Scorer's deadline (it kills the scoring process) bounds the call instead.
    gold = mv.parse("\\boxed{" + gold_text + "}", parsing_timeout=None)
    guess = mv.parse("\\boxed{" + predicted + "}", parsing_timeout=None)
    if not gold or not guess:
        return 0.0
    return 1.0 if mv.verify(gold, guess, timeout_seconds=None) else 0.0


def _numbers_close(predicted: str, reference: str) -> bool:
    a, b = as_number(normalize(predicted)), as_number(normalize(reference_answer(reference)))
    return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


_MV: list[Any] = []


def load_math_verify() -> Any:
    """The math_verify module, or None when it is not installed (imported once, lazily)."""
    if not _MV:
        try:
            import math_verify
            import math_verify.grader
            import math_verify.parser
        except ImportError:
            _MV.append(None)
        else:
            # We enforce our own deadline; silence its one-time "timeout disabled" warning.
            math_verify.parser.TIMEOUT_WARNING_SHOWN = True
            math_verify.grader.TIMEOUT_WARNING_SHOWN = True
            _MV.append(math_verify)
    return _MV[0]


# ---------------------------------------------------------------------------- task checkers

_MULTIPLY = ("\\times", "\\cdot", "\u00d7", "\u00b7", "\u2217")
_ALLOWED_OPS = (ast.Add, ast.Sub, ast.Mult)


def check_countdown(text: str, problem: Problem) -> float:
    """1 when the boxed expression uses only the given numbers (each at most once) with
    + - * and parentheses, and equals the target; else 0."""
    boxed = extract_answer(text)
    if boxed is None:
        return 0.0
    expr = boxed
    for sym in _MULTIPLY:
        expr = expr.replace(sym, "*")
    expr = normalize(expr)
    if not expr or len(expr) > 500:
        return 0.0
    target = int(problem.meta["target"])
    lhs, *rhs = expr.split("=")
    if any(as_number(part) != target for part in rhs):  # "3 * 4 = 12" is fine
        return 0.0
    try:
        tree = ast.parse(lhs, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return 0.0
    used = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
        elif not isinstance(node, (ast.Expression, ast.BinOp, *_ALLOWED_OPS)):
            return 0.0  # names, calls, unary minus, floats, ...: not a countdown answer
    if Counter(used) - Counter(int(x) for x in problem.meta["numbers"]):
        return 0.0
    return 1.0 if _evaluate(tree.body) == target else 0.0


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant):
        return node.value
    assert isinstance(node, ast.BinOp)
    a, b = _evaluate(node.left), _evaluate(node.right)
    if isinstance(node.op, ast.Add):
        return a + b
    return a - b if isinstance(node.op, ast.Sub) else a * b


CHECKERS: dict[str, Callable[[str, Problem], float]] = {"countdown": check_countdown}


def task_reward(text: str, problem: Problem, base: Callable[[str, str], float]) -> float:
    """Score with the problem's checker when it names one, else `base(text, answer)`."""
    checker = problem.meta.get("checker")
    if checker:
        return CHECKERS[checker](text, problem)
    return base(text, problem.answer)


def is_correct(text: str, problem: Problem) -> bool:
    """The binary notion of correctness: the task's checker, else the `match` comparison."""
    try:
        return task_reward(text, problem, match_reward) >= CORRECT_AT
    except Exception:
        return False


"""Reward functions: `match`, `math`, `format` (a regex) and `custom` ("module:function").

The reward functions are pure (a custom module is imported). `build_scorer` turns a
RewardConfig into a `Scorer` that runs them in a child process (see reward_worker.py) and
whose `score()` never raises: a scorer that raises, returns junk, dies or runs past
`reward.timeout_s` gives 0 for that completion and counts as a failure.

Task-specific checks plug in through `Problem.meta["checker"]`, a name in `CHECKERS`
(built in: "countdown"). For `match` and `math` such a problem is scored by its checker
instead of comparing the boxed answer with `Problem.answer`.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

from retrain.config import RewardConfig
from retrain.errors import UserError
from retrain.reward_worker import StartupError, WorkerProcess

if TYPE_CHECKING:
    from retrain.tasks import Problem

CORRECT_AT = 1 - 1e-9  # a reward at or above this counts as correct
MAX_ERRORS_KEPT = 5

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
    mv = _math_verify()
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


def _math_verify() -> Any:
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


# ---------------------------------------------------------------------------- custom rewards

_FORMAT_HINT = "use 'module:function' or 'path/to/file.py:function'"


def load_custom(spec: str, config_dir: Path) -> Callable[..., Any]:
    """Import the function named by reward.function, relative to the config file's folder."""
    where = f"reward.function = {spec!r}"
    target, sep, name = spec.strip().rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise UserError(f"{where}: {_FORMAT_HINT}")
    config_dir = Path(config_dir)
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _import_file(target, config_dir, where)
    else:
        module = _import_module(target, config_dir, where)
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items()
                         if callable(v) and not k.startswith("_"))
        raise UserError(f"{where}: {target} has no function {name!r}"
                        + (f"; it defines {', '.join(defined)}" if defined else ""))
    if not callable(fn):
        raise UserError(f"{where}: {target}.{name} is a {type(fn).__name__}, not a function")
    return fn


def _import_file(target: str, config_dir: Path, where: str) -> Any:
    path = Path(target).expanduser()
    if not path.is_absolute():
        path = config_dir / path
    if not path.is_file():
        raise UserError(f"{where}: no file {path} (relative paths start at the config file's "
                        f"folder, {config_dir})")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
    name = f"retrain_reward_{digest}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"{where}: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up here
    try:
        with _on_sys_path(path.parent, config_dir):
            spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise UserError(f"{where}: importing {path} failed: {type(exc).__name__}: {exc}") \
            from None
    return module


def _import_module(target: str, config_dir: Path, where: str) -> Any:
    try:
        with _on_sys_path(config_dir):
            return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name and (target == exc.name or target.startswith(exc.name + ".")):
            raise UserError(f"{where}: no module {target!r} in {config_dir} or on the Python "
                            "path; put it next to the config file or give a file path, "
                            "e.g. 'rewards.py:my_reward'") from None
        raise UserError(f"{where}: importing {target!r} failed: {exc}") from None
    except Exception as exc:
        raise UserError(f"{where}: importing {target!r} failed: {type(exc).__name__}: "
                        f"{exc}") from None


@contextlib.contextmanager
def _on_sys_path(*folders: Path) -> Iterator[None]:
    """Put folders first on sys.path for the duration of an import."""
    added = [str(f) for f in folders if str(f) not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for f in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(f)


def _check_signature(fn: Callable[..., Any], params: dict, spec: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and some C functions have no signature to check
    try:
        sig.bind("completion", "answer", **params)
    except TypeError as exc:
        raise UserError(f"reward.function = {spec!r} cannot be called as fn(completion, answer"
                        f", **reward.params): {exc}; make it accept (completion: str, answer: str"
                        + (", " + ", ".join(params) if params else "") + ")") from None


# ---------------------------------------------------------------------------- scoring

STARTUP_TIMEOUT_S = 120.0  # importing math-verify or a custom module on a busy machine


@dataclass
class Scores:
    rewards: list[float]
    correct: list[bool]
    failures: int
    errors: list[str] = field(default_factory=list)  # the first few failure messages


def reward_function(reward: RewardConfig, config_dir: Path
                    ) -> tuple[Callable[[str, Problem], Any], bool]:
    """(fn(text, problem) -> reward, whether the reward itself is the correctness)."""
    kind = reward.type
    if kind == "match":
        return (lambda t, p: task_reward(t, p, match_reward)), True
    if kind == "math":
        _math_verify()  # import it now, not against the first completion's deadline
        return (lambda t, p: task_reward(t, p, math_reward)), True
    if kind == "format":
        try:
            rx = re.compile(reward.pattern)
        except re.error as exc:
            raise UserError(f"reward.pattern = {reward.pattern!r} is not a valid regex: "
                            f"{exc}") from None
        return (lambda t, p: 1.0 if rx.search(t) else 0.0), False
    if kind == "custom":
        fn = load_custom(reward.function, config_dir)
        params = dict(reward.params)
        _check_signature(fn, params, reward.function)
        return (lambda t, p: fn(t, p.answer, **params)), False
    raise UserError(f"reward.type = {kind!r}; use 'match', 'math', 'format' or 'custom'")


def score_one(fn: Callable[[str, Problem], Any], reward_is_correctness: bool, text: str,
              problem: Problem) -> tuple[float, bool, str]:
    """(reward, correct, error); a failing or junk-returning `fn` gives (0, False, why)."""
    try:
        value = fn(text, problem)
    except BaseException as exc:  # SystemExit from a user function included
        return 0.0, False, _clip(f"{type(exc).__name__}: {exc}")
    reward = _as_reward(value)
    if reward is None:
        return 0.0, False, _clip(f"returned {value!r}, not a finite number")
    correct = reward >= CORRECT_AT if reward_is_correctness else is_correct(text, problem)
    return reward, correct, ""


def _as_reward(value: Any) -> float | None:
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        reward = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return reward if math.isfinite(reward) else None


def _clip(message: str, limit: int = 300) -> str:
    return message if len(message) <= limit else message[: limit - 3] + "..."


class Scorer:
    """Scores completions one by one in a child process, each within `timeout_s`.

    The child is killed when a completion runs past its deadline (or it dies) and a fresh
    one scores the rest. One caller at a time; `close()` stops the child.
    """

    def __init__(self, reward: RewardConfig, config_dir: Path):
        self.timeout_s = reward.timeout_s
        self._setup = {"reward": dataclasses.asdict(reward), "config_dir": str(config_dir)}
        self._worker: WorkerProcess | None = self._start()

    def _start(self) -> WorkerProcess:
        try:
            return WorkerProcess(self._setup, STARTUP_TIMEOUT_S)
        except StartupError as exc:
            raise UserError(str(exc)) from None

    def score(self, texts: list[str], problems: list[Problem]) -> Scores:
        """Reward and correctness of texts[i] against problems[i]; never raises."""
        if len(texts) != len(problems):
            raise ValueError(f"{len(texts)} texts but {len(problems)} problems")
        out = Scores(rewards=[], correct=[], failures=0)
        broken = ""  # why the worker cannot be restarted during this call
        for i, (text, problem) in enumerate(zip(texts, problems, strict=True)):
            reward, correct, error = (0.0, False, broken) if broken else \
                self._score_one(text, problem)
            if error.startswith("restart failed"):
                broken = error
            out.rewards.append(reward)
            out.correct.append(correct)
            if error:
                out.failures += 1
                if len(out.errors) < MAX_ERRORS_KEPT:
                    out.errors.append(f"completion {i}: {error}")
        return out

    def _score_one(self, text: str, problem: Problem) -> tuple[float, bool, str]:
        if self._worker is None:
            try:
                self._worker = self._start()
            except UserError as exc:
                return 0.0, False, _clip(f"restart failed: {exc}")
        request = {"text": text, "prompt": problem.prompt, "answer": problem.answer,
                   "meta": problem.meta}
        try:
            status, reply = self._worker.call(request, self.timeout_s)
            if status == "ok":
                reward, correct, error = reply
                return float(reward), bool(correct), str(error)
        except Exception:  # a garbled reply: treat the process as broken
            status = "died"
        self._worker.close()
        self._worker = None
        if status == "timeout":
            return 0.0, False, f"timed out after {self.timeout_s:g}s"
        return 0.0, False, "the reward process died (its error is printed above)"

    def close(self) -> None:
        """Stop the child process (also done when the Scorer is garbage collected)."""
        worker, self._worker = getattr(self, "_worker", None), None
        if worker is not None:
            worker.close()

    __del__ = close


def build_scorer(reward: RewardConfig, config_dir: Path) -> Scorer:
    """A Scorer for `[reward]`; UserError when a custom function cannot be imported."""
    return Scorer(reward, Path(config_dir).resolve())

"""Prompt sources: built-in procedural tasks with verifiable answers, JSONL files (plain or
chat form) and Hugging Face datasets on this machine (hf_source.py).

`load_task` builds a train split and a held-out eval split (disjoint, deterministic per seed),
`DataCursor` walks the train split in a seeded order that resumes exactly, and `render_prompt`
turns a problem into token ids. No torch here; the tokenizer is passed in.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrain.config.paths import special_file
from retrain.config.sections import DataConfig
from retrain.environments.answers import CHECKERS, Problem
from retrain.environments.chat_problems import (
    CHAT_EXAMPLE,
    chat_problem,
    opening_messages,
    problem_key,
    prompt_text,  # noqa: F401  (re-exported: importers of tasks.prompt_text)
)
from retrain.environments.ledger import token_ids
from retrain.errors import UserError
from retrain.runfiles import safejson

# Rejection sampling gives up after this many duplicates in a row (the space is exhausted).
_MAX_MISSES = 2000
# Index spaces up to this size are shuffled whole when most of them are needed.
_DENSE_LIMIT = 2_000_000


@dataclass
class TaskSplits:
    train: list[Problem]
    eval: list[Problem]


def load_task(data: DataConfig, seed: int, config_dir: Path) -> TaskSplits:
    """The train and held-out eval problems of `data.source` (deterministic for `seed`)."""
    if data.source == "arithmetic":
        return _arithmetic_splits(data, seed)
    if data.source == "countdown":
        return _countdown_splits(data, seed)
    if data.source == "jsonl":
        path = data_path(data, Path(config_dir))
        return hold_out(read_jsonl(path), data, seed, str(path))
    if data.source == "hf":
        from retrain.environments.hf_source import load_hf_problems

        problems, where = load_hf_problems(data, Path(config_dir))
        return hold_out(problems, data, seed, where)
    raise UserError(f"data.source = {data.source!r} is not a task; use 'arithmetic', "
                    "'countdown', 'jsonl' or 'hf'")


# ---------------------------------------------------------------------------- arithmetic


def _arithmetic_splits(data: DataConfig, seed: int) -> TaskSplits:
    ops = list(dict.fromkeys(data.operations))  # keep order, drop repeats
    lo = 0 if data.digits == 1 else 10 ** (data.digits - 1)
    width = 10 ** data.digits - lo  # operands per side
    space = len(ops) * width * width

    def problem(index: int) -> Problem:
        op_i, rest = divmod(index, width * width)
        a, b = lo + rest // width, lo + rest % width
        op = ops[op_i]
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return Problem(prompt=f"What is {a} {op} {b}?", answer=str(value),
                       meta={"task": "arithmetic", "a": a, "b": b, "op": op})

    where = f"{data.digits}-digit arithmetic with {' '.join(ops)}"
    if data.eval_size >= space:
        raise UserError(f"data.eval_size = {data.eval_size} leaves no training problems: "
                        f"{where} has only {space} distinct problems; lower data.eval_size "
                        "or raise data.digits")
    eval_idx = _distinct_indices(_rng("arithmetic-eval", seed), space, data.eval_size, set())
    train_idx = _distinct_indices(_rng("arithmetic-train", seed), space, data.size,
                                  set(eval_idx))
    return TaskSplits(train=[problem(i) for i in train_idx],
                      eval=[problem(i) for i in eval_idx])


def _distinct_indices(rng: random.Random, space: int, k: int, exclude: set[int]) -> list[int]:
    """Up to `k` distinct indices in range(space) not in `exclude`, in random order."""
    k = min(k, space - len(exclude))
    if k <= 0:
        return []
    if space <= _DENSE_LIMIT and 4 * (k + len(exclude)) >= space:
        pool = [i for i in range(space) if i not in exclude]
        rng.shuffle(pool)
        return pool[:k]
    seen: set[int] = set()
    out: list[int] = []
    while len(out) < k:
        i = rng.randrange(space)
        if i not in exclude and i not in seen:
            seen.add(i)
            out.append(i)
    return out


# ---------------------------------------------------------------------------- countdown

COUNTDOWN_MAX_NUMBER = 20  # given numbers are drawn from 1..20
COUNTDOWN_MAX_TARGET = 500


def _countdown_splits(data: DataConfig, seed: int) -> TaskSplits:
    n = data.countdown_numbers

    def draw(rng: random.Random) -> tuple[Hashable, Problem]:
        problem = countdown_problem(rng, n)
        return (tuple(sorted(problem.meta["numbers"])), problem.meta["target"]), problem

    eval_keys, eval_set = _distinct_draws(_rng("countdown-eval", seed), draw,
                                          data.eval_size, set())
    if len(eval_set) < data.eval_size:
        raise UserError(f"data.eval_size = {data.eval_size}: countdown with {n} numbers has "
                        f"only {len(eval_set)} distinct problems; lower data.eval_size")
    _, train = _distinct_draws(_rng("countdown-train", seed), draw, data.size, eval_keys)
    if not train:
        raise UserError(f"data.eval_size = {data.eval_size} leaves no countdown training "
                        "problems; lower data.eval_size")
    return TaskSplits(train=train, eval=eval_set)


def countdown_problem(rng: random.Random, n: int) -> Problem:
    """A countdown problem with `n` numbers whose target is reachable (a solution is kept)."""
    while True:
        numbers = [rng.randint(1, COUNTDOWN_MAX_NUMBER) for _ in range(n)]
        used = rng.sample(numbers, rng.randint(2, n))
        value, expr = _random_expression(rng, used)
        if 1 <= value <= COUNTDOWN_MAX_TARGET and value not in numbers:
            break
    shown = ", ".join(str(x) for x in numbers[:-1]) + f" and {numbers[-1]}"
    prompt = (f"Using the numbers {shown}, each at most once, and the operations +, - and *, "
              f"write an expression that equals {value}.")
    meta = {"task": "countdown", "checker": "countdown", "numbers": numbers, "target": value,
            "solution": expr}
    return Problem(prompt=prompt, answer=str(value), meta=meta)


def _random_expression(rng: random.Random, numbers: list[int]) -> tuple[int, str]:
    """Combine all `numbers` with random + - * into one expression: (value, text)."""
    pool = [(x, str(x)) for x in numbers]
    while len(pool) > 1:
        (a, ea), (b, eb) = pool.pop(rng.randrange(len(pool))), pool.pop(rng.randrange(len(pool)))
        op = rng.choice("+-*")
        if op == "-" and b > a:  # keep intermediate values non-negative
            (a, ea), (b, eb) = (b, eb), (a, ea)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        pool.append((value, f"({ea} {op} {eb})"))
    value, text = pool[0]
    return value, text[1:-1] if text.startswith("(") else text


def _distinct_draws(rng: random.Random, draw: Callable[[random.Random], tuple[Hashable, Any]],
                    k: int, exclude: set) -> tuple[set, list]:
    """Up to `k` draws with distinct keys not in `exclude`; stops when the space runs dry."""
    keys: set = set()
    out: list = []
    misses = 0
    while len(out) < k and misses < _MAX_MISSES:
        key, item = draw(rng)
        if key in keys or key in exclude:
            misses += 1
            continue
        misses = 0
        keys.add(key)
        out.append(item)
    return keys, out


# ---------------------------------------------------------------------------- jsonl

_EXAMPLE = '{"prompt": "What is 2 + 3?", "answer": "5"}'


def data_path(data: DataConfig, config_dir: Path) -> Path:
    """data.path, relative to the config file's folder."""
    path = Path(data.path).expanduser()
    return path if path.is_absolute() else config_dir / path


def hold_out(problems: list[Problem], data: DataConfig, seed: int, where: str) -> TaskSplits:
    """A seeded eval split of `data.eval_size` problems; the rest (minus repeats of held-out
    questions) train."""
    if data.eval_size >= len(problems):
        raise UserError(f"data.eval_size = {data.eval_size} but {where} has only "
                        f"{len(problems)} problems, which leaves none for training; lower "
                        "data.eval_size (0 = no eval split)")
    order = list(range(len(problems)))
    _rng("jsonl", seed).shuffle(order)
    held = sorted(order[: data.eval_size])
    held_prompts = {problem_key(problems[i]) for i in held}
    # A prompt repeated in the file must not sit on both sides of the split.
    train = [p for p in problems if problem_key(p) not in held_prompts]
    if not train:
        raise UserError(f"{where}: every training prompt also appears in the eval split; "
                        "lower data.eval_size")
    return TaskSplits(train=train, eval=[problems[i] for i in held])


def read_jsonl(path: Path, key: str = "data.path") -> list[Problem]:
    """Problems from a JSONL file; any bad line is a UserError naming file:line and the fix.
    `key`: the config key that named the file (sft.data.path reads through here too)."""
    if not path.is_file():
        what = "is a folder" if path.is_dir() else \
            f"is {special_file(path)}, not a regular file" if special_file(path) else \
            "does not exist"
        raise UserError(f"{key}: {path} {what}; point {key} at a JSONL file "
                        f"(relative to the config file) with lines like {_EXAMPLE}")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{key}: {path} cannot be read: {exc.strerror}") from None
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise UserError(f"{key}: {path} is UTF-16 text (it starts with a UTF-16 byte order "
                        "mark); save it as UTF-8")
    raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark (Windows editors)
    problems = []
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        if line.strip():
            problems.append(_parse_line(line, f"{path}:{lineno}"))
    if not problems:
        raise UserError(f"{path}: no problems in the file; add lines like {_EXAMPLE}")
    return problems


def _parse_line(line: bytes, where: str) -> Problem:
    fix = f"each line must be one JSON object like {_EXAMPLE} or {CHAT_EXAMPLE}"
    try:
        obj = safejson.loads(line)  # limits: deep nesting and huge integers are bad lines
    except safejson.BadJSON as exc:
        raise UserError(f"{where}: {exc}; {fix}") from None
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(obj).__name__}; {fix}")
    if "messages" in obj and "prompt" in obj:  # which one the model sees would be a guess
        raise UserError(f"{where}: give \"prompt\" or \"messages\", not both; {fix}")
    if "messages" in obj:
        messages, answer = obj.pop("messages"), obj.pop("answer", None)
        _check_checker(obj, where)
        return chat_problem(messages, answer, where, meta=obj)
    missing = [k for k in ("prompt", "answer") if k not in obj]
    if missing:
        raise UserError(f"{where}: missing {' and '.join(repr(k) for k in missing)}; {fix}")
    prompt, answer = obj.pop("prompt"), obj.pop("answer")
    if not isinstance(prompt, str) or not prompt.strip():
        raise UserError(f"{where}: \"prompt\" must be a non-empty string; {fix}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise UserError(f"{where}: \"answer\" must be a string or a number; {fix}")
    _check_checker(obj, where)
    return Problem(prompt=prompt, answer=str(answer), meta=obj)


def _check_checker(meta: dict, where: str) -> None:
    name = meta.get("checker")
    if name is not None and name not in CHECKERS:
        known = ", ".join(repr(c) for c in CHECKERS)
        raise UserError(f"{where}: unknown \"checker\" {name!r}; use one of {known} or leave "
                        "it out to compare with \"answer\"")
    if name == "countdown":
        numbers, target = meta.get("numbers"), meta.get("target")
        ints = isinstance(numbers, list) and numbers and all(
            type(x) is int for x in [*numbers, target])
        if not ints:
            raise UserError(f"{where}: \"checker\": \"countdown\" needs \"numbers\" (a list of "
                            "integers) and \"target\" (an integer), e.g. "
                            '{"prompt": "...", "answer": "10", "checker": "countdown", '
                            '"numbers": [2, 5], "target": 10}')


# ---------------------------------------------------------------------------- order and prompts


def _rng(purpose: str, seed: int) -> random.Random:
    # String seeds hash with SHA-512 inside `random`: stable across runs and platforms.
    return random.Random(f"retrain:{purpose}:{seed}")


class DataCursor:
    """Walks `n_items` indices epoch by epoch (a seeded reshuffle each epoch when `shuffle`)."""

    def __init__(self, n_items: int, seed: int, shuffle: bool = True):
        if n_items < 1:
            raise ValueError("DataCursor needs at least one item")
        self.n_items = n_items
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order: tuple[int, list[int]] | None = None

    def order(self, epoch: int) -> list[int]:
        """The item order of one epoch."""
        if self._order is None or self._order[0] != epoch:
            items = list(range(self.n_items))
            if self.shuffle:
                _rng(f"cursor:{epoch}", self.seed).shuffle(items)
            self._order = (epoch, items)
        return self._order[1]

    def take(self, k: int) -> list[int]:
        """The next `k` indices, moving into the next epoch when this one runs out."""
        out: list[int] = []
        while len(out) < k:
            order = self.order(self.epoch)
            chunk = order[self.position: self.position + k - len(out)]
            out += chunk
            self.position += len(chunk)
            if self.position >= self.n_items:
                self.epoch += 1
                self.position = 0
        return out

    def state_dict(self) -> dict:
        return {"n_items": self.n_items, "seed": self.seed, "shuffle": self.shuffle,
                "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where a saved cursor stopped (the same data is required)."""
        saved = state.get("n_items", self.n_items)
        if saved != self.n_items:
            raise UserError(f"the saved data cursor covers {saved} training problems but the "
                            f"data now has {self.n_items}, so resuming cannot replay the same "
                            "order; restore the data or start over with --new")
        self.seed = state.get("seed", self.seed)
        self.shuffle = state.get("shuffle", self.shuffle)
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = None


def render_prompt(tokenizer: Any, problem: Problem, data: DataConfig) -> list[int]:
    """Token ids of the prompt (chat template when asked for and the tokenizer has one)."""
    messages = opening_messages(problem, data)
    if data.chat_template and getattr(tokenizer, "chat_template", None):
        return token_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                       tokenize=True))
    # the same plain join as the rollout's Renderer
    return token_ids(tokenizer("\n".join(m["content"] for m in messages)))

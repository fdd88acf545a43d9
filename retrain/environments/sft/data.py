"""[sft.data]: the conversations of the SFT stage, read by the loaders of [data] (a JSONL file
of chat or prompt/answer lines, tasks.py; a Hugging Face dataset, hf_source.py), and the
number of steps the stage takes.

Each row becomes one conversation: the messages the model is shown (system prompt and earlier
turns kept, `instruction` on the last user turn) and the reply it learns: the row's final
assistant turn, or its answer (`{"prompt", "answer"}` lines, `answer_field`). Earlier
assistant turns are learned too. A row with neither is the loaders' one-line error naming
file:line.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from retrain.config.sections import DataConfig
from retrain.config.sft_section import SftConfig, sft_data_config
from retrain.environments.answers import Problem
from retrain.environments.chat_problems import opening_messages
from retrain.environments.ledger import Renderer
from retrain.environments.protocol import Message
from retrain.environments.sft.datums import EMPTY, LONG, never_trains
from retrain.environments.tasks import data_path, read_jsonl
from retrain.errors import UserError

SHOWN_ROWS = 5  # rows named in a message; the rest are counted


@dataclass
class SftData:
    """The SFT stage's conversations, where they came from, and [sft.data] as [data]."""

    conversations: list[list[Message]]
    where: str
    data: DataConfig

    @property
    def rows(self) -> int:
        return len(self.conversations)


def data_config(sft: SftConfig) -> DataConfig:
    """[sft.data] as the [data] loaders take it (nothing held out)."""
    return DataConfig(**dataclasses.asdict(sft_data_config(sft)), eval_size=0)


def load_sft(sft: SftConfig, config_dir: Path) -> SftData:
    """Every conversation of [sft.data]; a UserError naming the key, the file or row and the
    fix on bad input."""
    data = data_config(sft)
    if data.source == "jsonl":
        path = data_path(data, Path(config_dir))
        problems, where = read_jsonl(path, "sft.data.path"), str(path)
    else:
        from retrain.environments.hf_source import load_hf_problems

        problems, where = load_hf_problems(data, Path(config_dir), "sft.data")
    return SftData([conversation(p, data) for p in problems], where, data)


def conversation(problem: Problem, data: DataConfig) -> list[Message]:
    """The messages shown and the reply learned (the final assistant turn, or the answer)."""
    return [*opening_messages(problem, data), {"role": "assistant", "content": problem.answer}]


def sft_steps(sft: SftConfig, rows: int) -> int:
    """sft.steps, or the steps sft.epochs passes over `rows` conversations take."""
    return sft.steps or math.ceil(sft.epochs * rows / sft.batch_size)


def describe(sft: SftConfig, data: SftData) -> str:
    """One line for `retrain explain`: the data, its rows and the steps."""
    steps = sft_steps(sft, data.rows)
    how = f"{sft.epochs} epochs = " if not sft.steps else ""
    return (f"{data.where} ({data.data.source}, {data.rows} conversations): {how}{steps} steps "
            f"x {sft.batch_size} conversations, lr {sft.lr}, up to {sft.max_tokens} tokens "
            "each; only the assistant tokens are trained")


def never_trained(data: SftData, renderer: Renderer, max_tokens: int) -> str:
    """The conversations that can never train a token, counted by why with their first rows
    (numbered from 1), for `retrain explain`; "" when every one can."""
    found: dict[str, list[int]] = {LONG: [], EMPTY: []}
    for row, messages in enumerate(data.conversations, start=1):
        try:
            why = never_trains(renderer, messages, max_tokens)
        except Exception as exc:  # the template refuses it (roles, order): the run's line
            raise UserError(f"sft.data: conversation {row} of {data.where} cannot be rendered "
                            f"with the model's chat template ({type(exc).__name__}: "
                            f"{str(exc)[:200]}); fix the row, or set sft.data.chat_template = "
                            "false") from None
        if why is not None:
            found[why].append(row)
    if not any(found.values()):
        return ""
    said = {LONG: f"{LONG} = {max_tokens}", EMPTY: EMPTY}
    parts = [f"{len(rows)} with {said[why]} ({_rows(rows)})" for why, rows in found.items()
             if rows]
    total = sum(len(rows) for rows in found.values())
    return (f"sft.data: {total} of {data.rows} conversations of {data.where} can never train "
            f"a token: {'; '.join(parts)}; the run skips them (fix or drop those rows"
            + (", or raise sft.max_tokens)" if found[LONG] else ")"))


def _rows(rows: list[int]) -> str:
    shown = ", ".join(str(r) for r in rows[:SHOWN_ROWS])
    return f"row{'s' if len(rows) > 1 else ''} {shown}" + (" ..." if len(rows) > SHOWN_ROWS
                                                           else "")

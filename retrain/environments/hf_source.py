"""`[data] source = "hf"`: problems from a Hugging Face dataset already on this machine.

`data.path` is a folder written by `save_to_disk`, a folder of data files, one parquet /
arrow / json / jsonl / csv file, or a dataset name in the local Hugging Face cache. The
`datasets` library runs offline here (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE): a run never
downloads. Each row gives a prompt (`prompt_field`, or chat messages in `messages_field`) and
an answer (`answer_field`); a field the dataset lacks is a UserError listing its columns.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from retrain.config.paths import special_file
from retrain.config.sections import DataConfig
from retrain.environments.answers import Problem
from retrain.environments.chat_problems import chat_problem
from retrain.environments.hf_files import FILE_KINDS, content_key, files_read, say_files_used
from retrain.errors import UserError


def load_hf_problems(data: DataConfig, config_dir: Path,
                     key: str = "data") -> tuple[list[Problem], str]:
    """(the problems of data.split, a name for messages). `key`: the table the settings came
    from, as messages name them (`sft.data` reads through here too)."""
    raw = Path(data.path).expanduser()
    path = raw if raw.is_absolute() else config_dir / raw
    where = f"{key}.path = {data.path!r}"
    datasets = _offline_datasets(key)
    loaded = _load(datasets, path, data.path, where, key)
    table = _pick_split(loaded, data.split, where, key)
    return _problems(table, data, where, key), f"{where} (split {data.split!r})"


def _offline_datasets(key: str) -> Any:
    """The `datasets` module, told never to reach the network (before and after import)."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import datasets
    except ImportError:
        raise UserError(f"{key}.source = 'hf' needs the datasets library: pip install "
                        "'retrain[data]'") from None
    import huggingface_hub.constants as hub  # read at import: set it too, if imported before

    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    datasets.disable_progress_bars()
    return datasets


def _load(datasets: Any, path: Path, name: str, where: str, key: str) -> Any:
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors: our one line
    try:
        if path.is_file():
            kind = FILE_KINDS.get(path.suffix.lower())
            if kind is None:
                raise UserError(f"{where}: {path} is not a dataset file; use a "
                                f"{', '.join(FILE_KINDS)} file or a dataset folder")
            return datasets.load_dataset(kind, data_files=str(path),
                                         description=_content(path.resolve()))
        if special_file(path):  # reading it would wait for a writer, or never end
            raise UserError(f"{where}: {path} is {special_file(path)}, not a dataset file or "
                            f"folder; point {key}.path at a {', '.join(FILE_KINDS)} file or a "
                            "dataset folder")
        if path.is_dir():
            if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
                return datasets.load_from_disk(str(path))  # its Arrow files, read as they are
            builder = datasets.load_dataset_builder(str(path))
            say_files_used(builder, path, where, key)
            return datasets.load_dataset(str(path), description=_content(*files_read(builder)))
        return datasets.load_dataset(name)
    except UserError:
        raise
    except Exception as exc:  # the library's many errors: one line, the why and the fix
        what = (f"{path} cannot be read as a dataset" if path.exists() else
                f"no file or folder {path}, and {name!r} is not a dataset in the local "
                "Hugging Face cache (runs never download: load it once online, or "
                f"save_to_disk / to_parquet it and point {key}.path there)")
        raise UserError(f"{where}: {what}: {_why(exc)}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)


def _content(*files: Path) -> str:
    """A builder setting `datasets` keys its cache by (with paths and mtimes): the files' bytes,
    so a file rewritten with its old mtime is read again (hf_files.py)."""
    return f"retrain content sha256 {content_key(list(files))}"


def _why(exc: BaseException) -> str:
    """The error that caused `exc`, in one line: the library wraps a parse error in its own
    (DatasetGenerationError: "An error occurred while generating the dataset")."""
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__  # `raise ... from`: the error it stands for
        seen.add(id(exc))
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:300]}"


def _pick_split(loaded: Any, split: str, where: str, key: str) -> Any:
    if not hasattr(loaded, "keys"):  # a single Dataset (save_to_disk of one split)
        return loaded
    if split not in loaded:
        raise UserError(f"{key}.split = {split!r}: {where} has splits "
                        f"{', '.join(repr(k) for k in loaded)}; set {key}.split to one of them")
    return loaded[split]


def _problems(table: Any, data: DataConfig, where: str, key: str) -> list[Problem]:
    columns = list(table.column_names)
    prompt_key = data.messages_field or data.prompt_field
    prompt_name = f"{key}.messages_field" if data.messages_field else f"{key}.prompt_field"
    _need(prompt_key, prompt_name, columns, where)
    answer_key: str | None = data.answer_field
    if answer_key not in columns:
        if not data.messages_field:  # chat rows may end with the reference assistant turn
            _need(data.answer_field, f"{key}.answer_field", columns, where)
        answer_key = None
    keep = [k for k in (prompt_key, answer_key) if k]
    rows = table.select_columns(keep).to_list()
    if not rows:
        raise UserError(f"{where}: split {data.split!r} has no rows")
    return [_row_problem(row, prompt_key, answer_key, bool(data.messages_field),
                         f"{where}, row {i}") for i, row in enumerate(rows, start=1)]


def _need(key: str, name: str, columns: list[str], where: str) -> None:
    if key not in columns:
        raise UserError(f"{name} = {key!r}: {where} has no such column; its columns are "
                        f"{', '.join(repr(c) for c in columns)}")


def _row_problem(row: dict, prompt_key: str, answer_key: str | None, chat: bool,
                 where: str) -> Problem:
    answer = row.get(answer_key) if answer_key else None
    if chat:
        return chat_problem(row[prompt_key], answer, where)
    prompt = row[prompt_key]
    if not isinstance(prompt, str) or not prompt.strip():
        raise UserError(f"{where}: the prompt ({prompt_key!r}) must be non-empty text, got "
                        f"{prompt!r:.80}")
    if answer is None or isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise UserError(f"{where}: the answer ({answer_key!r}) must be a string or a number, "
                        f"got {answer!r:.80}")
    return Problem(prompt=prompt, answer=str(answer))

"""The local data files a `[data] source = "hf"` path makes `datasets` read: a key over their
bytes for its cache, and a warning naming the files of a folder it leaves out, with the cause.

`datasets` keys its Arrow cache by each file's path and modification time, so a file rewritten
with its old mtime (`cp -p`, `rsync -a`, unpacking an archive) would be served from the cache as
it was. The content key below goes into the cache's key too, so what a run reads is what is on
disk now.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

FILE_KINDS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json",
              ".csv": "csv"}
_CHUNK = 1 << 20


def content_key(files: list[Path]) -> str:
    """sha256 over the files' names and bytes (order-free): their content, not their mtimes."""
    h = hashlib.sha256()
    for path in sorted(files, key=str):
        h.update(f"{path}\0".encode())
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def files_read(builder: Any) -> list[Path]:
    """The local files a `datasets` builder reads, every split."""
    return [Path(str(f)).resolve() for files in builder.config.data_files.values()
            for f in files]


def say_files_used(builder: Any, folder: Path, where: str, key: str) -> None:
    """A warning per cause of data files in `folder` that `datasets` ignored: files of a format
    it did not pick (it reads one format), and files whose names give no split (once a file is
    named for a split, `train*`, `test*`, `validation*`, only such files make up the splits)."""
    used = set(files_read(builder))
    data = sorted(p for p in folder.rglob("*") if p.is_file()
                  and p.suffix.lower() in FILE_KINDS
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    read = [p for p in data if p.resolve() in used]
    kinds = {FILE_KINDS[p.suffix.lower()] for p in read}
    other_kind = [p for p in data if p not in read and FILE_KINDS[p.suffix.lower()] not in kinds]
    unsplit = [p for p in data if p not in read and p not in other_kind]
    if other_kind:
        _warn(f"{where}: the folder holds data files of several formats and `datasets` reads "
              f"one: it read {_names(folder, read)} ({builder.name}) and ignored "
              f"{_names(folder, other_kind)}; point {key}.path at one file, or keep one format "
              "in the folder")
    if unsplit:
        splits = ", ".join(f"{_names(folder, [Path(str(f)).resolve() for f in files])} "
                           f"({split})" for split, files in builder.config.data_files.items())
        _warn(f"{where}: only files named for a split (train*, test*, validation*) make up the "
              f"splits once one file is: `datasets` read {splits} and ignored "
              f"{_names(folder, unsplit)}, whose names give no split; point {key}.path at one "
              "file, or name each file for its split (train-2.parquet, ...)")


def _warn(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)


def _names(folder: Path, paths: list[Path], shown: int = 5) -> str:
    names = [p.resolve().relative_to(folder.resolve()).as_posix() for p in paths]
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more"
                                       if len(names) > shown else "")

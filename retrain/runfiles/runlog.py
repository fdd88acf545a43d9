"""Run files: metrics.jsonl (append + flush per row), atomic JSON state, and their readers.

Readers never fail on a torn last line or garbage lines: they skip and count them, so a
crash mid-write can never break `status` or resume.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import secrets
import socket
import stat
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from retrain.runfiles import safejson

METRICS_FILE = "metrics.jsonl"
STATE_FILE = "state.json"
CONFIG_FILE = "config.toml"
MANIFEST_FILE = "manifest.json"
CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_PREFIX = "step-"        # checkpoints/step-000012/ (and its resume point .json)
TINKER_SCHEME = "tinker://"        # a checkpoint kept by the tinker service, not in the folder
PLOT_FILE = "usl.png"              # `retrain plot RUN_DIR` draws here by default


def json_safe(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null so every reader can parse every row."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def replace_atomically(path: Path, data: bytes) -> None:
    """Write via temp file + fsync + rename (+ directory fsync): readers see old or new. The
    file gets the mode a plain open would give it: its old mode, else 0666 less the umask."""
    fd, tmp = _new_temp(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _new_temp(path: Path) -> tuple[int, str]:
    """A new temp file beside `path`, opened for writing (not mkstemp: it forces mode 0600)."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mode = None
    while True:
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                         0o666)  # less the umask, as open() does
            break
        except FileExistsError:
            continue
    if mode is not None:
        with contextlib.suppress(OSError):  # some filesystems keep no modes
            os.fchmod(fd, mode)
    return fd, tmp


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write JSON via temp file + fsync + rename, so readers see the old or the new file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(json_safe(obj), indent=2, sort_keys=False) + "\n"
    replace_atomically(path, text.encode("utf-8"))


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable (best effort: some filesystems refuse to open folders)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_json(path: str | Path) -> dict | None:
    """Read a JSON object, or None when it is missing, unreadable or hostile (safejson)."""
    try:
        return safejson.read_object(path)
    except (OSError, ValueError):
        return None


@dataclass
class MetricsRead:
    """Rows parsed from a metrics file, and how many lines were skipped as torn or garbage."""

    rows: list[dict] = field(default_factory=list)
    bad_lines: int = 0


def read_metrics(path: str | Path) -> MetricsRead:
    """Parse metrics.jsonl, skipping (and counting) lines that are not JSON objects
    (torn, garbage, or beyond safejson's limits)."""
    out = MetricsRead()
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return out
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            row = safejson.loads(line)
        except ValueError:
            out.bad_lines += 1
            continue
        if isinstance(row, dict):
            out.rows.append(row)
        else:
            out.bad_lines += 1
    return out


class MetricsWriter:
    """Appends one JSON object per step to metrics.jsonl, flushed and fsynced per row."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "ab")  # noqa: SIM115 (kept open for the whole run)
        if _ends_torn(self.path):
            # A crash left half a row: end it, so the next row is not glued onto it.
            self._fh.write(b"\n")
            self._fh.flush()

    def write(self, row: dict) -> None:
        line = json.dumps(json_safe(row), separators=(",", ":")).encode() + b"\n"
        self._fh.write(line)
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ends_torn(path: Path) -> bool:
    """Whether a non-empty file lacks its final newline."""
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        if fh.tell() == 0:
            return False
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) != b"\n"


def truncate_metrics(path: str | Path, keep_through_step: int) -> int:
    """Rewrite metrics.jsonl keeping rows with step <= keep_through_step (resume: no duplicates).

    Returns how many rows were dropped. Torn and garbage lines are dropped too.
    """
    path = Path(path)
    if not path.exists():
        return 0
    read = read_metrics(path)
    kept = [r for r in read.rows
            if type(r.get("step")) is int and r["step"] <= keep_through_step]  # not bool
    dropped = len(read.rows) - len(kept)
    if dropped == 0 and read.bad_lines == 0:
        return 0
    replace_atomically(path, b"".join(json.dumps(row, separators=(",", ":")).encode() + b"\n"
                                       for row in kept))
    return dropped


# Run states as written in state.json; `status` adds "stale" (says running, process gone).
BUDGET, BUDGET_EXIT = "budget", 3  # a run or campaign stopped by its budget: status, exit status
RUN_STATUSES = ("pending", "running", "completed", "failed", "interrupted", BUDGET)


@dataclass
class RunState:
    """state.json: where a run stands and everything needed to resume it exactly."""

    status: str = "pending"
    step: int = 0                      # last completed step (0 = none)
    max_steps: int = 0
    pid: int = 0
    host: str = ""
    started_at: float = 0.0
    updated_at: float = 0.0
    data_cursor: dict = field(default_factory=dict)
    rng: dict = field(default_factory=dict)
    controller: dict = field(default_factory=dict)
    checkpoint: str = ""               # backend ref of the last saved state
    batch_size: int = 0                # batch size of the next step (back-pressure may change it)
    error: str = ""
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> RunState:
        """The state in `d`; ValueError naming the first field a resume cannot trust."""
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        state = cls(**known)
        problem = state.problem()
        if problem:
            raise ValueError(problem)
        return state

    def problem(self) -> str:
        """What makes this state unusable for a resume ("" when it is sound). Timestamps,
        pid, host and error are only informative: odd values there are reset, not fatal."""
        for name in ("started_at", "updated_at"):
            if not _is_number(getattr(self, name)):
                setattr(self, name, 0.0)
        self.pid = self.pid if _is_count(self.pid) else 0
        self.host = self.host if isinstance(self.host, str) else ""
        self.error = self.error if isinstance(self.error, str) else str(self.error)[:2000]
        if self.status not in RUN_STATUSES:
            return f"status is {self.status!r}, not one of {', '.join(RUN_STATUSES)}"
        for name in ("step", "max_steps", "batch_size"):
            if not _is_count(getattr(self, name)):
                return f"{name} is {getattr(self, name)!r}, not a whole number >= 0"
        for name in ("data_cursor", "rng", "controller", "extra"):
            if not isinstance(getattr(self, name), dict):
                return f"{name} is {type(getattr(self, name)).__name__}, not an object"
        if not isinstance(self.checkpoint, str):
            return f"checkpoint is {self.checkpoint!r}, not a string"
        return ""

    def resume_problem(self) -> str:
        """What a trainer resuming after `step` would miss ("" when nothing)."""
        if self.step == 0:
            return ""
        if not self.checkpoint:
            return f"step is {self.step} but no checkpoint is named"
        missing = [k for k in ("epoch", "position") if not _is_count(self.data_cursor.get(k))]
        if missing:
            return f"data_cursor lacks a valid {' and '.join(missing)}"
        named = checkpoint_step(self.checkpoint)
        if named is not None and named != self.step:
            return f"step is {self.step} but the checkpoint is of step {named}"
        return ""

    def to_dict(self) -> dict:
        return asdict(self)


def save_state(run_dir: str | Path, state: RunState) -> None:
    """Atomically write state.json, stamping who wrote it and when."""
    state.updated_at = time.time()
    state.pid = state.pid or os.getpid()
    state.host = state.host or socket.gethostname()
    write_json_atomic(Path(run_dir) / STATE_FILE, state_record(run_dir, state))


def state_record(run_dir: str | Path, state: RunState) -> dict:
    """`state` as state.json and resume points hold it: the checkpoint relative to the run
    folder (`checkpoints/step-000012`), so that it never names another folder's."""
    record = state.to_dict()
    ref = state.checkpoint
    if ref and not ref.startswith(TINKER_SCHEME):
        inside = Path(os.path.abspath(ref))
        with contextlib.suppress(ValueError):  # outside: kept as is, read back by its name
            record["checkpoint"] = inside.relative_to(os.path.abspath(run_dir)).as_posix()
    return record


def own_checkpoint(run_dir: str | Path, ref: str) -> str:
    """The checkpoint a record names, as a path to this run's own: `run_dir/checkpoints/<name>`.
    Records before this rule held the path the training process used (absolute, or relative to
    its working folder), which may name another run's folder once this one moved or is read
    from elsewhere: only the name counts. ValueError for a ref that names no checkpoint of a
    run folder. tinker:// refs and "" come back as they are."""
    if not ref or ref.startswith(TINKER_SCHEME):
        return ref
    path = Path(ref)
    if path.parent.name != CHECKPOINT_DIR or checkpoint_step(path.name) is None:
        raise ValueError(f"its checkpoint {ref!r} is outside the run folder {run_dir}: a run "
                         f"only uses its own checkpoints ({CHECKPOINT_DIR}/{CHECKPOINT_PREFIX}N "
                         "in its folder)")
    return os.path.join(os.path.abspath(run_dir), CHECKPOINT_DIR, path.name)


def read_record(run_dir: str | Path, path: str | Path) -> RunState:
    """A state record of `run_dir` (state.json or a resume point), validated, its checkpoint
    resolved by `own_checkpoint`; OSError, ValueError or TypeError when unusable."""
    state = RunState.from_dict(safejson.read_object(path))
    state.checkpoint = own_checkpoint(run_dir, state.checkpoint)
    return state


@dataclass
class StateRead:
    """state.json as found: the state, or why it cannot be used ("" = absent)."""

    state: RunState | None
    problem: str = ""


def read_state(run_dir: str | Path) -> StateRead:
    """state.json, validated; a torn, hostile or hand-broken file comes back as a problem."""
    try:
        return StateRead(read_record(run_dir, Path(run_dir) / STATE_FILE))
    except FileNotFoundError:
        return StateRead(None)
    except OSError as exc:
        return StateRead(None, f"cannot be read ({exc.strerror or exc})")
    except (ValueError, TypeError) as exc:
        return StateRead(None, str(exc) or type(exc).__name__)


def save_state_even_if_full(run_dir: str | Path, state: RunState) -> None:
    """save_state; on a full disk (no room for the temp file) overwrite state.json in place
    instead, compact and padded to its old size so that no new block is needed: a run that
    dies of a full disk must still read "failed", not "running". The error text is cut to fit.
    """
    try:
        save_state(run_dir, state)
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        full = exc
    path = Path(run_dir) / STATE_FILE
    size = path.stat().st_size
    d = json_safe(state_record(run_dir, state))
    data = json.dumps(d, separators=(",", ":")).encode()
    while len(data) > size and d["error"]:
        d["error"] = d["error"][: max(0, len(d["error"]) - (len(data) - size) - 3)]
        data = json.dumps(d, separators=(",", ":")).encode()
    if len(data) > size:
        raise full
    with open(path, "r+b") as fh:
        fh.write(data + b" " * (size - len(data)))
        fh.flush()
        os.fsync(fh.fileno())


def disk_full_error(exc: BaseException, folder: str | Path) -> OSError | None:
    """An ENOSPC OSError when `exc` came from a full disk under `folder`, else None.

    Libraries report a full disk in their own ways (torch.save: a RuntimeError with no errno),
    so the disk itself is asked: a 1 MiB probe file that cannot be written means it is full.
    """
    if isinstance(exc, OSError):
        return exc if exc.errno in (errno.ENOSPC, errno.EDQUOT) else None
    if not isinstance(exc, Exception):
        return None
    try:
        with tempfile.TemporaryFile(dir=folder) as fh:
            fh.write(b"\0" * (1 << 20))
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as probe:
        if probe.errno in (errno.ENOSPC, errno.EDQUOT):
            return OSError(probe.errno, os.strerror(probe.errno), str(folder))
    return None


def load_state(run_dir: str | Path) -> RunState | None:
    """The run's state.json, or None when absent, unreadable or not a sound state."""
    return read_state(run_dir).state


def checkpoint_step(ref: str) -> int | None:
    """The step in a checkpoint ref's last part (`.../step-000012` -> 12), else None."""
    name = ref.rstrip("/").rsplit("/", 1)[-1]
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    digits = name[len(CHECKPOINT_PREFIX):]
    return int(digits) if digits.isascii() and digits.isdigit() and len(digits) < 19 else None


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def pid_alive(pid: int, host: str = "") -> bool:
    """Whether a process on this host is alive (a pid from another host counts as unknown=False)."""
    if pid <= 0 or (host and host != socket.gethostname()):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------------- finding runs

_SKIP_DIRS = {CHECKPOINT_DIR, "__pycache__"}


def is_run_dir(folder: Path) -> bool:
    """A run folder holds metrics.jsonl or state.json."""
    return (folder / METRICS_FILE).is_file() or (folder / STATE_FILE).is_file()


def is_campaign_dir(folder: Path) -> bool:
    return (folder / MANIFEST_FILE).is_file()


def walk_logs(root: str | Path, max_depth: int = 6) -> tuple[list[Path], list[Path]]:
    """(run folders, campaign folders) at or below `root`, sorted; runs inside campaigns
    are included. Checkpoint and hidden folders are not searched."""
    root = Path(root)
    runs: list[Path] = []
    campaigns: list[Path] = []
    base_depth = len(root.parts)
    for dirpath, dirnames, _ in os.walk(root, onerror=lambda _e: None):
        folder = Path(dirpath)
        if is_campaign_dir(folder):
            campaigns.append(folder)
        if is_run_dir(folder):
            runs.append(folder)
            dirnames[:] = []  # a run's subfolders are its checkpoints
            continue
        if len(folder.parts) - base_depth >= max_depth:
            dirnames[:] = []
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
    return sorted(runs), sorted(campaigns)

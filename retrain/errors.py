"""User-facing errors: the CLI prints their message (no traceback) and exits with status 2."""

from __future__ import annotations

import errno


class UserError(Exception):
    """Bad input or a missing prerequisite; the message names the file/key and the fix."""

    exit_code = 2

    def __init__(self, message: str = "", exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


# errno -> (what it means, the fix, exit status). A path problem is a setup error (2, like a
# config error); a full disk or another I/O failure is a run that failed (1).
_OS_ERRORS = {
    errno.ENOSPC: ("no space left on the device", "free some space (or point logging.log_dir "
                   "at another disk), then run the same command again to resume", 1),
    errno.EDQUOT: ("disk quota exceeded", "free some space, then run the same command again "
                   "to resume", 1),
    errno.EROFS: ("read-only file system", "point logging.log_dir at a writable folder", 2),
    errno.EACCES: ("permission denied", "point logging.log_dir at a folder you can write, or "
                   "fix its permissions", 2),
    errno.EPERM: ("operation not permitted", "point logging.log_dir at a folder you can write",
                  2),
    errno.ENOTDIR: ("a part of this path is a file, not a folder", "move the file away or "
                    "point logging.log_dir elsewhere", 2),
    errno.EEXIST: ("a file is in the way of a folder", "move the file away or point "
                   "logging.log_dir elsewhere", 2),
    errno.EISDIR: ("is a folder, expected a file", "give the path of a file", 2),
    errno.ENOENT: ("no such file or folder", "check the path", 2),
}


def user_error_from_os(exc: OSError, context: str = "") -> UserError:
    """The one place an OSError becomes a one-line message naming the path and the fix."""
    meaning, fix, code = _OS_ERRORS.get(exc.errno or -1, (exc.strerror or str(exc), "", 1))
    path = exc.filename if exc.filename is not None else exc.filename2
    where = f"{path}: " if path is not None else ""
    prefix = f"{context}: " if context else ""
    return UserError(f"{prefix}{where}{meaning}" + (f"; {fix}" if fix else ""), exit_code=code)

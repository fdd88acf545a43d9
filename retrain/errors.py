"""User-facing errors: the CLI prints their message (no traceback) and exits with status 2."""


class UserError(Exception):
    """Bad input or a missing prerequisite; the message names the file/key and the fix."""

    exit_code = 2

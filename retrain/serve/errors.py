"""The error every part of `retrain serve` raises for an immediate HTTP answer."""

from __future__ import annotations


class ApiError(Exception):
    """An immediate HTTP error: status code + message (never a traceback)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message

"""The error every part of `retrain serve` raises for an immediate HTTP answer."""

from __future__ import annotations


class ApiError(Exception):
    """An immediate HTTP error: status code + message (never a traceback)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


# Statuses the tinker SDK answers by sending the same request again (its
# `execute_with_retries`); any other 4xx is final, and the SDK moves on to its next request.
SDK_RETRIES = frozenset({408, 409, 429})


def final_refusal(exc: Exception) -> bool:
    """Whether the client will not send this refused request again (a 400 names a field)."""
    status = getattr(exc, "status", 400)
    return status < 500 and status not in SDK_RETRIES

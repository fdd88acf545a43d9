"""Overload answers (HTTP 429/502/503/504) the tinker SDK receives, for the campaign's
concurrency controller.

The SDK retries those answers inside its HTTP client, so the backend never sees them; it
logs each retry on `tinker._base_client` at DEBUG ("Retrying due to status code %i").
`watch_overload` adds a filter to that logger that hands each such code to a callback. To see
the records it lowers the logger to DEBUG, and the filter then drops every record below the
level the logger had before, so nothing new is printed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

SDK_LOGGER = "tinker._base_client"
RETRY_MESSAGE = "Retrying due to status code"


class OverloadFilter(logging.Filter):
    def __init__(self, callback: Callable[[int], None], keep_from: int):
        super().__init__()
        self.callback = callback
        self.keep_from = keep_from

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(RETRY_MESSAGE) and record.args:
            code = record.args[0] if isinstance(record.args, tuple) else None
            if isinstance(code, int):
                self.callback(code)
        return record.levelno >= self.keep_from


def watch_overload(callback: Callable[[int], None]) -> OverloadFilter:
    """Call `callback(status)` for every answer the SDK retries; returns the filter (remove
    it with `logging.getLogger(SDK_LOGGER).removeFilter`)."""
    logger = logging.getLogger(SDK_LOGGER)
    keep_from = logger.getEffectiveLevel()
    f = OverloadFilter(callback, keep_from)
    logger.addFilter(f)
    if keep_from > logging.DEBUG:
        logger.setLevel(logging.DEBUG)
    return f

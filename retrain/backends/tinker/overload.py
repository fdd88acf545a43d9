"""Overload answers (HTTP 429/502/503/504) the tinker SDK receives, for the campaign's
concurrency controller.

The SDK retries those answers by itself, in two places (its HTTP client for most requests,
its own loop for the long-polled futures), so the backend never sees them, and only the first
place logs them. Below both, httpx logs every response it receives on the `httpx` logger at
INFO ('HTTP Request: %s %s "%s %d %s"', the fourth argument the status code).
`watch_overload` adds a filter to that logger that hands each status to a callback. To see the
records it lowers the logger to INFO when it is above, and the filter then drops every record
below the level the logger had before, so nothing new is printed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

HTTP_LOGGER = "httpx"
RESPONSE_MESSAGE = "HTTP Request: "


class OverloadFilter(logging.Filter):
    def __init__(self, callback: Callable[[int], None], keep_from: int):
        super().__init__()
        self.callback = callback
        self.keep_from = keep_from

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(RESPONSE_MESSAGE) \
                and isinstance(record.args, tuple) and len(record.args) >= 4 \
                and isinstance(record.args[3], int):
            self.callback(record.args[3])
        return record.levelno >= self.keep_from


def watch_overload(callback: Callable[[int], None]) -> OverloadFilter:
    """Call `callback(status)` for every HTTP response the SDK receives; returns the filter
    (remove it with `logging.getLogger(HTTP_LOGGER).removeFilter`)."""
    logger = logging.getLogger(HTTP_LOGGER)
    keep_from = logger.getEffectiveLevel()
    f = OverloadFilter(callback, keep_from)
    logger.addFilter(f)
    if keep_from > logging.INFO:
        logger.setLevel(logging.INFO)
    return f

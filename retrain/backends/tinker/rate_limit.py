"""HTTP 429 from a Tinker service: queue, don't fail. The wait is the service's Retry-After
where it sends one (bounded), else an exponential backoff; with jitter either way."""

from __future__ import annotations

import email.utils
import logging
import math
import random
import time

log = logging.getLogger("retrain.tinker")  # the same logger as the backend's

RATE_LIMIT_FIRST_S = 0.5   # backoff on HTTP 429: 0.5 s doubling to 15 s, times 0.5-1 jitter
RATE_LIMIT_CAP_S = 15.0    # also the longest Retry-After obeyed
RATE_LIMIT_MIN_S = 0.1     # the shortest wait, even when the service says "retry now"
RETRY_AFTER_JITTER = 1.25  # a Retry-After wait is stretched by 1 to this factor, never cut
RATE_LIMIT_WARN_EVERY_S = 60.0


class RateLimited(Exception):
    """The service answered 429 (too many sessions or requests): wait, then send again;
    `retry_after` is the wait the service asked for, in seconds (None: it did not say)."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


def retry_after_s(exc: BaseException) -> float | None:
    """The seconds an HTTP error's Retry-After header asks for (a number or an HTTP date),
    or None when it has none or it is not one of those."""
    try:
        value = exc.response.headers.get("retry-after")  # type: ignore[attr-defined]
    except Exception:  # not an HTTP status error
        return None
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return max(0.0, seconds) if math.isfinite(seconds) else None


QUEUES_429_HEADER = "X-Retrain-Queues-429"  # tells retrain serve that we back off ourselves

# Requests that open a training client: the backend queues these itself on 429 (with the
# slot given back), so the SDK must not retry them while the slot is held.
QUEUED_ROUTES = ("/create_model", "/load_weights")


def is_rate_limited(exc: BaseException) -> bool:
    return getattr(exc, "status_code", None) == 429


def _queued_route(exc: BaseException) -> bool:
    try:
        return str(exc.response.request.url.path).endswith(QUEUED_ROUTES)  # type: ignore[attr-defined]
    except Exception:  # not an HTTP status error
        return False


def stop_sdk_retrying_429(service) -> None:
    """Make the SDK's own retry loop (`execute_with_retries`: up to 5 minutes, inside our
    slot) raise a 429 on the routes the backend queues itself, so that its backoff waits
    with the slot given back. Other routes keep the SDK's retries: they are ordered by
    seq_id, and only the SDK re-sends them under the same one; the slot is given back while
    the SDK sleeps before such a re-send (`slot_lease`). `retrain serve` also answers
    clients that send QUEUES_429_HEADER with `x-should-retry: false` on its session-limit
    429s, which stops the SDK's HTTP-level retries of them."""
    holder = service._get_session_holder()  # the pinned SDK's session (created on first use)
    if getattr(holder, "_retrain_queues_429", False):
        return
    retryable = holder._is_retryable_exception

    def is_retryable(exc: Exception) -> bool:
        if is_rate_limited(exc) and _queued_route(exc):
            return False
        return retryable(exc)

    holder._is_retryable_exception = is_retryable
    holder._retrain_queues_429 = True


class RateLimitWait:
    """The waits of one request that keeps getting 429: what the service's Retry-After asks
    (within RATE_LIMIT_MIN_S..RATE_LIMIT_CAP_S, stretched by up to a quarter), else
    exponential backoff with jitter.

    The jitter comes from the OS, not the seeded `random`, so campaign workers that share a
    seed do not retry in lockstep. A warning goes out on the first 429 and once a minute.
    """

    def __init__(self, what: str):
        self.what = what
        self.attempts = 0
        self.total_s = 0.0
        self._warned_at = -math.inf
        self._rng = random.SystemRandom()

    def sleep(self, reason: str, retry_after: float | None = None) -> float:
        if self.total_s - self._warned_at >= RATE_LIMIT_WARN_EVERY_S:
            self._warned_at = self.total_s
            log.warning("tinker %s: rate-limited (HTTP 429), waiting and retrying "
                        "(%.0f s so far): %s", self.what, self.total_s, reason)
        delay = self.delay(retry_after)
        self.attempts += 1
        start = time.monotonic()
        time.sleep(delay)
        slept = time.monotonic() - start
        self.total_s += slept
        return slept

    def delay(self, retry_after: float | None) -> float:
        """The next wait: never sooner than the service asked (unless it asked for more
        than RATE_LIMIT_CAP_S), spread so that waiting clients do not return in lockstep."""
        if retry_after is not None:
            asked = min(RATE_LIMIT_CAP_S, max(RATE_LIMIT_MIN_S, retry_after))
            return asked * self._rng.uniform(1.0, RETRY_AFTER_JITTER)
        delay = min(RATE_LIMIT_CAP_S, RATE_LIMIT_FIRST_S * 2 ** self.attempts)
        return delay * self._rng.uniform(0.5, 1.0)

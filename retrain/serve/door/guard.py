"""ASGI middleware in front of the API: shared-key check, added latency, traffic counting,
fault injection.

Added latency (`delay_s`, `retrain serve --delay-ms`): every API request waits that long
before it is handled, a stand-in for a network round trip in tests and benchmarks.

A load model (`LoadModel`, `retrain serve --load-model "base_ms=B,sigma=S,kappa=K,fail_above=F"`)
simulates a hosted endpoint with a known capacity curve: with N API requests in flight (this
one included), a request first waits B*(1 + S*(N-1) + K*N*(N-1)) ms, on top of the real work,
and one that arrives while more than F others are in flight gets HTTP 502. Served throughput
then follows the Universal Scalability Law with p* = sqrt((1-S)/K).

Traffic counts concurrent API requests (heartbeat and telemetry excluded: the SDK sends
them from a background loop, outside any client-side throttling). A request stops
counting just before its last byte is sent, so a client can never see a reply while the
server still counts the request.

Fault injection (tests, chaos drills): a `FaultPlan` answers a fraction of requests with
429/502/504 before they reach the API (so a retry is always safe), or holds them for
`hang_s` seconds and then answers 504. Set it in code or with $RETRAIN_SERVE_FAULTS, e.g.
`429=0.1,502=0.05,504=0.05,hang=0.02,hang_s=20,seed=1,routes=asample+optim_step`; `after=N`
lets the first N eligible requests through untouched and `limit=N` stops after N faults.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import random
from dataclasses import dataclass, field

log = logging.getLogger("retrain.serve")

PREFIX = "/api/v1/"
OPENAI_PREFIX = "/v1/"
KEY_REFUSED = ("missing or wrong API key: set TINKER_API_KEY (or the openai client's api_key) "
               "to the key `retrain serve` was started with")
MAX_BODY_BYTES = 64 * 2**20  # the SDK sends forward_backward in chunks of about 5 MB
UNTHROTTLED = frozenset({"session_heartbeat", "telemetry"})
FAULT_CODES = ("429", "502", "504", "hang")


@dataclass
class FaultPlan:
    """Fractions of requests to fail, by kind; `routes` limits which routes (empty = all)."""

    rates: dict[str, float] = field(default_factory=dict)
    hang_s: float = 30.0
    seed: int = 0
    routes: frozenset[str] = frozenset()
    after: int = 0              # eligible requests let through before any fault
    limit: int | None = None    # at most this many faults (None = no limit)

    def __post_init__(self):
        bad = [k for k in self.rates if k not in FAULT_CODES]
        if bad or sum(self.rates.values()) > 1:
            raise ValueError(f"fault rates must be among {FAULT_CODES} and sum to <= 1, "
                             f"got {self.rates}")
        self._rng = random.Random(self.seed)
        self._seen = 0
        self._injected = 0

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        """'429=0.1,hang=0.05,hang_s=5,seed=3,routes=asample+forward_backward'."""
        rates: dict[str, float] = {}
        kwargs: dict = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = item.partition("=")
            if key == "hang_s":
                kwargs["hang_s"] = float(value)
            elif key == "seed":
                kwargs["seed"] = int(value)
            elif key == "routes":
                kwargs["routes"] = frozenset(filter(None, value.split("+")))
            elif key in ("after", "limit"):
                kwargs[key] = int(value)
            else:
                rates[key] = float(value)
        return cls(rates=rates, **kwargs)

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        text = os.environ.get("RETRAIN_SERVE_FAULTS", "")
        return cls.parse(text) if text.strip() else None

    def draw(self, route: str) -> str | None:
        """The fault to inject for one request on `route`, or None."""
        if route in UNTHROTTLED or (self.routes and route not in self.routes):
            return None
        self._seen += 1
        if self._seen <= self.after or (self.limit is not None and self._injected >= self.limit):
            return None
        x = self._rng.random()
        for kind in FAULT_CODES:
            x -= self.rates.get(kind, 0.0)
            if x < 0:
                self._injected += 1
                return kind
        return None


LOAD_KEYS = ("base_ms", "sigma", "kappa", "fail_above")
# The largest value each key takes: one minute of base latency (the SDK gives up on a
# request after 60 s), and the USL's contention and coherency fractions at most 1 (beyond,
# the endpoint would serve less at 2 requests in flight than at 1).
LOAD_MAX = {"base_ms": 60_000.0, "sigma": 1.0, "kappa": 1.0}


@dataclass(frozen=True)
class LoadModel:
    """Added latency that grows with the requests in flight, and a hard limit (502 beyond)."""

    base_ms: float = 0.0
    sigma: float = 0.0
    kappa: float = 0.0
    fail_above: int | None = None   # None: never refuse

    def __post_init__(self):
        for key, most in LOAD_MAX.items():
            value = getattr(self, key)
            if not 0 <= value <= most:  # also refuses NaN
                raise ValueError(f"{key} must be a number from 0 to {most:g}, got {value:g}")
        if self.fail_above is not None and self.fail_above < 0:
            raise ValueError(f"fail_above must be an integer >= 0, got {self.fail_above}")

    @classmethod
    def parse(cls, text: str) -> LoadModel:
        """'base_ms=50,sigma=0.05,kappa=0.005,fail_above=20' (every key optional)."""
        kwargs: dict = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, eq, value = (x.strip() for x in item.partition("="))
            if key not in LOAD_KEYS or not eq:
                raise ValueError(f"{item!r} is not KEY=VALUE with KEY one of "
                                 + ", ".join(LOAD_KEYS))
            if key in kwargs:
                raise ValueError(f"{key} is given twice")
            try:
                kwargs[key] = int(value) if key == "fail_above" else float(value)
            except ValueError:
                kind = "an integer" if key == "fail_above" else "a number"
                raise ValueError(f"{key}={value!r} is not {kind}") from None
        return cls(**kwargs)

    def delay_s(self, in_flight: int) -> float:
        """Seconds a request waits with `in_flight` requests in flight, itself included."""
        n = max(1, in_flight)
        return self.base_ms / 1000.0 * (1.0 + self.sigma * (n - 1) + self.kappa * n * (n - 1))

    def refuses(self, in_flight: int) -> bool:
        """A request that arrives while more than fail_above others are in flight: 502."""
        return self.fail_above is not None and in_flight - 1 > self.fail_above


@dataclass
class Traffic:
    """Concurrent API requests now and at peak, and how many faults were injected."""

    inflight: int = 0
    peak: int = 0
    requests: int = 0
    faults: dict[str, int] = field(default_factory=dict)

    def enter(self) -> None:
        self.inflight += 1
        self.requests += 1
        self.peak = max(self.peak, self.inflight)

    def leave(self) -> None:
        self.inflight -= 1

    def reset_peak(self) -> None:
        self.peak = self.inflight


class Guard:
    """ASGI middleware: key check, then counting, then the load model, then the added delay,
    then fault injection, then the app."""

    def __init__(self, app, api_key: str | None = None, faults: FaultPlan | None = None,
                 traffic: Traffic | None = None, delay_s: float = 0.0,
                 max_body_bytes: int = MAX_BODY_BYTES, load: LoadModel | None = None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key
        self.faults = faults
        self.traffic = traffic or Traffic()
        self.delay_s = delay_s
        self.load = load

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = path[len(PREFIX):] if path.startswith(PREFIX) else path
        if self.api_key is not None and not self._key_ok(scope):
            return await _json(send, 401, _shaped(path, KEY_REFUSED, "invalid_api_key"))
        if self._declared_size(scope) > self.max_body_bytes:
            return await _json(send, 413, _shaped(path, self._too_large()["error"]))
        receive = self._capped(receive)
        counted = route not in UNTHROTTLED
        if not counted:
            await self._delay(path)
            return await self.app(scope, receive, send)
        self.traffic.enter()
        left = False

        async def counted_send(message):
            nonlocal left
            if (message["type"] == "http.response.body" and not message.get("more_body")
                    and not left):
                left = True
                self.traffic.leave()
            await send(message)

        try:
            if self.load is not None:
                n = self.traffic.inflight
                if self.load.refuses(n):
                    self.traffic.faults["502"] = self.traffic.faults.get("502", 0) + 1
                    log.info("load model: 502 on %s (%d others in flight > fail_above %d)",
                             route, n - 1, self.load.fail_above)
                    return await _json(counted_send, 502, {
                        "error": f"overloaded: {n - 1} requests already in flight (--load-model "
                                 f"fail_above={self.load.fail_above})", "category": "server"})
                await asyncio.sleep(self.load.delay_s(n))
            await self._delay(path)
            fault = self.faults.draw(route) if self.faults else None
            if fault is None:
                await self.app(scope, receive, counted_send)
            else:
                self.traffic.faults[fault] = self.traffic.faults.get(fault, 0) + 1
                await self._inject(fault, receive, counted_send)
        finally:
            if not left:
                self.traffic.leave()

    def _too_large(self) -> dict:
        return {"error": f"request body over {self.max_body_bytes} bytes", "category": "user"}

    @staticmethod
    def _declared_size(scope) -> int:
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                return int(value) if value.isdigit() else 0
        return 0

    def _capped(self, receive):
        """`receive` that stops a body (e.g. chunked, with no length) past the cap."""
        seen = 0

        async def capped():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:  # the app's 413 handler answers it
                from starlette.exceptions import HTTPException

                raise HTTPException(413, self._too_large()["error"])
            return message
        return capped

    async def _delay(self, path: str) -> None:
        if self.delay_s > 0 and path.startswith(PREFIX):
            await asyncio.sleep(self.delay_s)

    def _key_ok(self, scope) -> bool:
        """The tinker SDK sends the key as X-API-Key, OpenAI clients as a Bearer token."""
        ok = False
        for name, value in scope.get("headers", []):
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                name, value = b"x-api-key", value[7:].strip()
            if name == b"x-api-key":
                ok |= hmac.compare_digest(value, self.api_key.encode())
        return ok

    async def _inject(self, fault: str, receive, send) -> None:
        if fault == "hang":
            await _until_disconnect(receive, self.faults.hang_s)
            fault = "504"
        status = int(fault)
        headers = [(b"retry-after", b"0")] if status == 429 else []
        await _json(send, status, {"error": f"injected fault {status}", "category": "server"},
                    headers)


async def _until_disconnect(receive, timeout: float) -> None:
    """Wait `timeout` seconds, or less if the client hangs up first."""
    async def watch():
        while (await receive())["type"] != "http.disconnect":
            pass
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(watch(), timeout)


def _shaped(path: str, message: str, code: str | None = None) -> dict:
    """An error body in the shape the path's clients read: OpenAI's under /v1/ (the openai
    SDK shows its message), Tinker's elsewhere."""
    if path.startswith(OPENAI_PREFIX):
        return {"error": {"message": message, "type": "invalid_request_error", "param": None,
                          "code": code}}
    return {"error": message, "category": "user"}


async def _json(send, status: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": data})

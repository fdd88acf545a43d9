"""HTTP routes of the Tinker API (the subset the SDK needs for an RL loop), on Starlette.

Each handler parses the body into the SDK's own pydantic request type, calls
`TinkerService`, and answers JSON, or protobuf for finished forward_backward / sample
futures. Unknown routes answer a JSON error naming the route. The OpenAI-compatible routes
(`openai_routes`, under /v1/) are added beside them, on the same service and engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pydantic
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tinker import types

from retrain.backends.tinker.rate_limit import QUEUES_429_HEADER
from retrain.serve.door.backlog import Backlog
from retrain.serve.door.guard import MAX_BODY_BYTES, FaultPlan, Guard, LoadModel, Traffic
from retrain.serve.door.inflate import inflate_zstd
from retrain.serve.door.validate import RequestError
from retrain.serve.engine import LOSS_INPUTS, Engine
from retrain.serve.errors import ApiError
from retrain.serve.openai.routes import OpenAIServing, build_openai_routes, error_reply
from retrain.serve.tinker import wire
from retrain.serve.tinker.futures import FutureStore
from retrain.serve.tinker.ordering import GAP_S
from retrain.serve.tinker.sampling import UNPOLLED_S
from retrain.serve.tinker.service import REAP_EVERY_S, SESSION_TIMEOUT_S, TinkerService

log = logging.getLogger("retrain.serve")
PROTO = "application/x-protobuf"

# Flags for the SDK (ClientConfigResponse): API keys without a JWT exchange.
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "credential_default_source": "api_key",
                 "custom_loss_server_side": False}  # the SDK runs custom losses client-side
CUSTOM_LOSS_REFUSED = (
    "retrain serve does not run uploaded loss graphs (it never executes what a client sends); "
    f"it computes {', '.join(LOSS_INPUTS)}. ServiceClient.create_custom_loss and "
    "forward_backward_custom work against it: the SDK runs the loss on the client "
    "(custom_loss_server_side is false)")


class ReplyJSON(JSONResponse):
    """JSON whose non-finite floats (a diverged run's metrics) are sent as the strings
    "nan" / "inf" / "-inf": JSON has no NaN (the SDK's orjson rejects the literal) and the
    SDK's pydantic models read such strings as floats. A reply that failed to render would
    answer every poll of its future with a 500."""

    def render(self, content) -> bytes:
        return json.dumps(_finite_json(content), ensure_ascii=False, allow_nan=False,
                          separators=(",", ":")).encode("utf-8")


def _finite_json(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf"
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_json(v) for v in value]
    return value


def _error(status: int, message: str, category: str = "user") -> JSONResponse:
    return JSONResponse({"error": message, "category": category}, status_code=status)


async def _parse(request: Request, model: type[pydantic.BaseModel]):
    try:
        return model.model_validate_json(await request.body())
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ApiError(400, f"bad {request.url.path} body: {where}: {first.get('msg')}") from None


Handler = Callable[[Request], Awaitable[Any]]
RouteSpec = tuple[str, str, Handler]  # (HTTP method, path under /api/v1/, handler)


def build_routes(service: TinkerService, max_body_bytes: int = MAX_BODY_BYTES) -> list[Route]:
    """The API routes, bound to one service; a zstd body may inflate to `max_body_bytes`."""
    table = [*_session_routes(service), *_training_routes(service, max_body_bytes),
             *_sampling_routes(service)]
    return [Route(f"/api/v1/{path}", _wrap(fn), methods=[method]) for method, path, fn in table]


def _reply(value: dict) -> Handler:
    """A handler that answers every request with `value`."""
    async def handler(request: Request):
        return value
    return handler


def _body(model: type[pydantic.BaseModel], call: Callable[[Any], Any],
          refused: Callable[[object, object], None] | None = None) -> Handler:
    """A handler that validates the JSON body as `model` and answers `call(body)` (awaited
    when the service method is async). A training request whose body does not validate is
    passed to `refused` with the model_id and seq_id it names, if any."""
    async def handler(request: Request):
        try:
            body = await _parse(request, model)
        except ApiError:
            if refused is not None:
                refused(*_ids_in(await request.body()))
            raise
        result = call(body)
        return await result if inspect.isawaitable(result) else result
    return handler


def _ids_in(body: bytes) -> tuple[object, object]:
    """(model_id, seq_id) of a JSON body that did not validate, where it names them."""
    try:
        data = json.loads(body)
    except ValueError:
        return None, None
    return (data.get("model_id"), data.get("seq_id")) if isinstance(data, dict) else (None, None)


def _path(call: Callable[..., Any], *params: str) -> Handler:
    """A handler that answers `call` of the named path parameters, in order."""
    async def handler(request: Request):
        return call(*(request.path_params[p] for p in params))
    return handler


# The lambdas look the service's method up on each call (a test may wrap one).
def _session_routes(s: TinkerService) -> list[RouteSpec]:
    """Client configuration, sessions, models, and the no-op housekeeping calls."""

    async def capabilities(request: Request):
        return {"supported_models": [{"model_name": s.engine.base_model, "trainable": True,
                                      "sampleable": True}]}

    return [
        ("POST", "client/config", _reply(CLIENT_CONFIG)),
        ("POST", "client/dynamic_config",
         _reply({"refresh_interval_sec": 300, "sample_cancel_enabled": False})),
        ("POST", "create_session",
         _body(types.CreateSessionRequest, lambda req: s.create_session(req))),
        ("POST", "session_heartbeat",
         _body(types.SessionHeartbeatRequest, lambda req: s.heartbeat(req.session_id))),
        ("POST", "sessions/{sid}/finish", _path(lambda sid: s.finish_session(sid), "sid")),
        ("POST", "create_model", _body(types.CreateModelRequest, lambda req: s.create_model(req))),
        ("POST", "get_info", _body(types.GetInfoRequest, lambda req: s.get_info(req.model_id))),
        ("POST", "telemetry", _reply({"status": "accepted"})),
        ("GET", "healthz", _reply({"status": "ok"})),
        ("GET", "get_server_capabilities", capabilities),
    ]


def _training_routes(s: TinkerService, max_body_bytes: int) -> list[RouteSpec]:
    """Forward/backward, optimizer steps, weights and checkpoints of training runs."""

    async def forward_backward(request: Request):
        if PROTO not in request.headers.get("content-type", ""):
            raise ApiError(415, "forward_backward takes a protobuf body (tinker SDK >= 0.25)")
        body = await request.body()
        if request.headers.get("content-encoding") == "zstd":
            body = inflate_zstd(body, max_body_bytes)
        try:
            call = wire.decode_forward_backward(body)
        except wire.BadCall as exc:  # still completes its place in the model's order
            s.refused(exc.model_id, exc.seq_id)
            raise ApiError(400, str(exc)) from None
        return s.forward_backward(call)

    def refused(model_id: object, seq_id: object) -> None:
        s.refused(model_id, seq_id)

    async def create_custom_loss(request: Request):  # the graph is never even read
        raise ApiError(400, CUSTOM_LOSS_REFUSED)

    return [
        ("POST", "forward_backward", forward_backward),
        ("POST", "create_custom_loss", create_custom_loss),
        ("POST", "optim_step",
         _body(types.OptimStepRequest, lambda req: s.optim_step(req), refused)),
        ("POST", "save_weights",
         _body(types.SaveWeightsRequest, lambda req: s.save_weights(req), refused)),
        ("POST", "save_weights_for_sampler",
         _body(types.SaveWeightsForSamplerRequest, lambda req: s.save_weights_for_sampler(req),
               refused)),
        ("POST", "load_weights",
         _body(types.LoadWeightsRequest, lambda req: s.load_weights(req), refused)),
        ("GET", "training_runs/{run}", _path(lambda run: s.get_training_run(run), "run")),
        ("DELETE", "training_runs/{run}/checkpoints/{cid:path}",
         _path(lambda run, cid: s.delete_checkpoint(run, cid), "run", "cid")),
    ]


def _sampling_routes(s: TinkerService) -> list[RouteSpec]:
    """Sampling sessions, sampling, and the futures every async call answers with."""

    async def retrieve_future(request: Request):
        req = await _parse(request, types.FutureRetrieveRequest)
        return await _retrieve(s, req.request_id, request)

    return [
        ("POST", "create_sampling_session", _body(types.CreateSamplingSessionRequest,
                                                  lambda req: s.create_sampling_session(req))),
        ("GET", "samplers/{sid}", _path(lambda sid: s.get_sampler(sid), "sid")),
        ("POST", "asample", _body(types.SampleRequest, lambda req: s.asample(req))),
        ("POST", "retrieve_future", retrieve_future),
        ("POST", "cancel_future", _reply({})),
    ]


def _wrap(handler):
    """JSON-encode a handler's dict; turn ApiError into a JSON error reply."""
    async def endpoint(request: Request) -> Response:
        try:
            result = await handler(request)
        except RequestError as exc:  # validate.py: a field out of range
            return _error(400, str(exc))
        except ApiError as exc:
            reply = _error(exc.status, exc.message)
            if exc.status == 429:  # the session limit: poll for a free place each second
                reply.headers["retry-after"] = "1"
                # retrain's backend backs off itself, its API slot given back: the SDK must not
                if request.headers.get(QUEUES_429_HEADER):  # retry inside the slot. Other
                    reply.headers["x-should-retry"] = "false"  # clients keep SDK retries.
            return reply
        return result if isinstance(result, Response) else ReplyJSON(result)
    return endpoint


async def _retrieve(s: TinkerService, request_id: str, request: Request) -> Response:
    """Long-poll one future: its result, an error object, or `try_again` after hold_s. A
    poll whose client hung up frees the request's sampling (`poll_abandoned`)."""
    if not s.futures.known(request_id):
        return _error(410, f"unknown or expired request {request_id}; resubmit it")
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        reply = await s.futures.wait(request_id, disconnected=gone)
    finally:
        hung_up = gone.done() and not gone.cancelled()
        gone.cancel()
    if reply is None and hung_up:
        s.poll_abandoned(request_id)
        return Response(status_code=499)  # nobody reads it
    if reply is None:
        return JSONResponse({"type": "try_again", "request_id": request_id,
                             "queue_state": "active"})
    if reply.error is not None:
        return JSONResponse({"error": reply.error, "category": reply.category})
    if reply.proto is not None:
        if PROTO not in request.headers.get("accept", ""):
            return _error(406, "this result is protobuf; use tinker SDK >= 0.25")
        return Response(reply.proto, media_type=PROTO)
    return ReplyJSON(reply.json)


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error_for(request: Request, status: int, message: str) -> Response:
    """An error in the shape the path's clients read: OpenAI's under /v1/, else Tinker's."""
    if request.url.path.startswith("/v1/"):
        return error_reply(status, message)
    return _error(status, message)


async def _not_found(request: Request, exc: Exception) -> Response:
    return _error_for(request, 404,
                      f"retrain serve does not implement {request.method} {request.url.path}")


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return _error_for(request, 405, f"{request.method} is not allowed on {request.url.path}")


async def _too_large(request: Request, exc: Exception) -> Response:
    return _error_for(request, 413, getattr(exc, "detail", "request body too large"))


def build_app(engine: Engine, state_dir: Path, *, api_key: str | None = None,
              faults: FaultPlan | None = None, hold_s: float = 30.0,
              reap_every_s: float = REAP_EVERY_S, delay_s: float = 0.0, max_sessions: int = 0,
              session_timeout_s: float = SESSION_TIMEOUT_S,
              max_body_bytes: int = MAX_BODY_BYTES, load: LoadModel | None = None,
              openai: OpenAIServing | None = None, order_gap_s: float = GAP_S,
              unpolled_s: float = UNPOLLED_S, max_queued_tokens: int | None = None
              ) -> tuple[Guard, TinkerService]:
    """The ASGI app (Starlette behind the Guard middleware) and its service; with `openai`,
    the OpenAI-compatible routes too.

    `delay_s` is added before every API request (`--delay-ms`), `load` simulates a hosted
    endpoint's capacity curve (`--load-model`); `max_sessions` caps the
    training clients alive at once (`--max-sessions`, 0 = no cap; beyond it: HTTP 429);
    `order_gap_s`: how long a model's queued ops wait for a seq_id that never came;
    `unpolled_s`: how long a sample request runs with nobody polling for it;
    `max_queued_tokens`: the bound on sampling taken on at once (`backlog`; None: none).
    """
    service = TinkerService(engine, state_dir, FutureStore(hold_s=hold_s),
                            max_sessions=max_sessions, session_timeout_s=session_timeout_s,
                            order_gap_s=order_gap_s, unpolled_s=unpolled_s,
                            backlog=Backlog(max_queued_tokens))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async def reap():
            while True:
                await asyncio.sleep(reap_every_s)
                service.reap()
        task = asyncio.create_task(reap())
        try:
            yield
        finally:
            task.cancel()
            service.close()

    routes = build_routes(service, max_body_bytes)
    if openai is not None:
        routes += build_openai_routes(service, openai)
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={404: _not_found, 405: _not_allowed,
                                        413: _too_large})
    return Guard(app, api_key=api_key, faults=faults, traffic=Traffic(),
                 delay_s=delay_s, max_body_bytes=max_body_bytes, load=load), service

"""Running the app under uvicorn: in the foreground (`retrain serve`) or in a thread (tests)."""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from retrain.errors import UserError
from retrain.serve.door.guard import FaultPlan, Guard, LoadModel
from retrain.serve.engine import Engine
from retrain.serve.openai.routes import OpenAIServing
from retrain.serve.tinker.routes import build_app

if TYPE_CHECKING:
    from retrain.serve.local_engine import LocalEngine
    from retrain.serve.openai.adapters import AdapterRun
from retrain.serve.tinker.service import TinkerService

log = logging.getLogger("retrain.serve")
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def default_state_dir() -> Path:
    """Where served checkpoints live: $RETRAIN_SERVE_DIR, else <retrain cache>/serve."""
    if os.environ.get("RETRAIN_SERVE_DIR"):
        return Path(os.environ["RETRAIN_SERVE_DIR"])
    from retrain.backends.models import cache_dir

    return cache_dir().parent / "serve"


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 = any free port); a bad host or port, or a port in use,
    is a UserError that says which and what to do."""
    if not 0 <= port <= 65535:
        raise UserError(f"retrain serve: --port {port} is not a TCP port (0-65535; 0 = any "
                        "free port)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise UserError(_bind_error(host, port, exc)) from None
    sock.set_inheritable(True)
    return sock


def _bind_error(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (f"retrain serve: port {port} on {host} is in use (another retrain serve?); "
                "pick another --port, or --port 0 for any free port")
    if exc.errno == errno.EACCES:
        return (f"retrain serve: no permission to listen on port {port} (ports below 1024 "
                "need root); pick --port 1024 or above")
    reason = exc.strerror or str(exc)
    return (f"retrain serve: cannot listen on --host {host!r} --port {port}: {reason} "
            "(use an address of this machine, e.g. 127.0.0.1 or 0.0.0.0)")


def _config(app, log_level: str) -> uvicorn.Config:
    # h11 + asyncio: pure-Python, predictable on every platform; no websockets needed.
    return uvicorn.Config(app, log_level=log_level, http="h11", loop="asyncio", ws="none",
                          lifespan="on", timeout_keep_alive=75, access_log=False)


def exposure_warning(host: str, has_key: bool) -> str | None:
    """What to tell the user when the server is reachable from other machines."""
    if host in LOOPBACK:
        return None
    return (f"warning: retrain serve listens on {host}: anyone who can reach this machine "
            "can train and sample on it" + ("" if has_key else "; set --api-key (or "
                                              "$RETRAIN_SERVE_API_KEY) to require a key"))


class _Server(uvicorn.Server):
    """uvicorn's server, which says on the first Ctrl-C what stopping waits for (uvicorn
    waits for the requests in flight, silently at our log level)."""

    def __init__(self, config: uvicorn.Config, app: Guard, service: TinkerService):
        super().__init__(config)
        self.guard = app
        self.service = service

    def handle_exit(self, sig, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first:
            print(stopping_line(self.guard.traffic.inflight, self.service.futures.pending(),
                                self.service.futures.hold_s), file=sys.stderr, flush=True)


def stopping_line(requests: int, jobs: int, hold_s: float) -> str:
    """What a first Ctrl-C waits for, in one line."""
    if not requests and not jobs:
        return "retrain serve: stopping"
    waits = []
    if requests:
        waits.append(f"{requests} request{'s' * (requests != 1)} in flight to end (a held "
                     f"poll answers within {hold_s:g} s)")
    if jobs:
        waits.append(f"{jobs} unfinished job{'s' * (jobs != 1)} (sampling stops, training "
                     "steps finish)")
    return (f"retrain serve: stopping; waiting for {' and '.join(waits)}; Ctrl-C again to "
            "stop now")


def run(app: Guard, host: str, sock: socket.socket, service: TinkerService) -> None:
    """Serve on the bound `sock` until interrupted."""
    warning = exposure_warning(host, app.api_key is not None)
    if warning:
        print(warning, file=sys.stderr)
    url = f"http://{host}:{sock.getsockname()[1]}"
    print(f"retrain serve: {url} (TINKER_BASE_URL for clients)", file=sys.stderr, flush=True)
    print(f"retrain serve: the OpenAI-compatible API is at {url}/v1 (base_url of the openai "
          "client)", file=sys.stderr, flush=True)
    try:
        _Server(_config(app, "warning"), app, service).run(sockets=[sock])
    finally:  # also after a second Ctrl-C, which skips the app's own shutdown
        service.close()


class ServerThread:
    """The app served on 127.0.0.1 from a daemon thread; `url` is its base URL."""

    def __init__(self, app: Guard, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning"):
        self.app = app
        self.sock = bind(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(_config(app, log_level))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="retrain-serve", daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("retrain serve failed to start")
            self.thread.join(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def serve_forever(model: str, host: str = "127.0.0.1", port: int = 8000,
                  api_key: str | None = None, dtype: str = "auto",
                  engine: Engine | None = None, state_dir: Path | None = None,
                  delay_ms: float = 0.0, max_sessions: int = 0,
                  load: LoadModel | None = None, adapters: list[str] | None = None,
                  max_queued_tokens: int = 0) -> None:
    """`retrain serve`: the Tinker API and the OpenAI-compatible API over the local backend,
    until Ctrl-C; `adapters` ("NAME=RUN_DIR[@STEP]") are run checkpoints served by name. The
    OpenAI routes need the local engine's tokenizer: a given `engine` serves the Tinker API
    only. `max_queued_tokens` bounds the sampling taken on at once (`backlog`; 0: the KV
    cache half the device's memory holds, for the local engine)."""
    from retrain.serve.openai.adapters import find_runs, parse_spec

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    api_key = api_key or os.environ.get("RETRAIN_SERVE_API_KEY") or None
    runs = find_runs([parse_spec(text) for text in adapters or []])  # before the model loads
    if runs and engine is not None:
        raise UserError("--adapter needs the local engine (leave `engine` out)")
    state_dir = state_dir or default_state_dir()
    sock = bind(host, port)  # before loading the model: a taken port fails in a second
    try:
        local = engine is None
        if engine is None:
            from retrain.serve.local_engine import LocalEngine

            engine = LocalEngine.load(model, dtype=dtype)
            print(f"retrain serve: model {engine.model.summary}", file=sys.stderr, flush=True)
            max_queued_tokens = max_queued_tokens or engine.queued_tokens_bound()
        openai = _openai_serving(engine, state_dir, runs) if local else None
    except BaseException:
        sock.close()
        raise
    app, service = build_app(engine, state_dir, api_key=api_key,
                             faults=FaultPlan.from_env(), delay_s=delay_ms / 1000.0,
                             max_sessions=max_sessions, load=load, openai=openai,
                             max_queued_tokens=max_queued_tokens or None)
    run(app, host, sock, service)


def _openai_serving(engine: LocalEngine, state_dir: Path,
                    runs: list[AdapterRun]) -> OpenAIServing:
    """The OpenAI routes' view of a local engine: its tokenizer, EOS ids and `--adapter`s."""
    from retrain.serve.checkpoints import CheckpointStore
    from retrain.serve.openai.adapters import load_adapters

    served = load_adapters(engine, CheckpointStore(state_dir, engine.base_model), runs)
    for a in served.values():
        print(f"retrain serve: adapter {a.name!r} = {a.run_dir} step {a.step}",
              file=sys.stderr, flush=True)
        if (line := a.fallback_line()) is not None:
            print(f"warning: {line}", file=sys.stderr, flush=True)
    return OpenAIServing(engine.model.tokenizer, frozenset(engine.model.eos_ids), served)

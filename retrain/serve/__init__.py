"""`retrain serve`: a Tinker-API-compatible server over the local backend.

Modules: `engine` (what the server needs from a model), `local_engine` (that, over the
local backend), `wire` (protobuf <-> engine types), `futures` (long-polled results),
`ordering` (seq_id order per model), `service` (the API's semantics), `guard` (key check,
traffic count, fault injection), `app` (Starlette routes), `server` (uvicorn).
"""

from retrain.serve.server import ServerThread, serve_forever

__all__ = ["ServerThread", "serve_forever"]

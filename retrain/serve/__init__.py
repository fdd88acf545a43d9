"""`retrain serve`: a Tinker-API-compatible server over the local backend.

Modules: `engine` (what the server needs from a model), `local_engine` (that, over the
local backend; stop tokens and strings end rows in the sampler), `wire` (protobuf <-> the
backend datatypes), `validate` (every check of what clients send), `futures` (long-polled
results), `ordering` (seq_id order per model), `sampling` (sample requests, and stopping
those of a gone client), `checkpoints` (tinker:// paths <-> folders), `service` (the API's
semantics), `errors` (ApiError), `guard` (key check, added delay, body cap, traffic count,
fault injection), `app` (Starlette routes), `server` (uvicorn).
The OpenAI-compatible API: `openai_routes`, `openai_wire` (request checks), `openai_models`
(model names), `adapters` (`--adapter` run checkpoints), `openai_reply`, `openai_stream`.
"""

from retrain.serve.server import ServerThread, serve_forever

__all__ = ["ServerThread", "serve_forever"]

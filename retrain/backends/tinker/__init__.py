"""The Tinker backend: the Backend contract on the official `tinker` SDK. `backend`
(TinkerBackend) over `calls` (the service client, its threads, slots and retries), with the
sampler, checkpoints, wire conversions, rate limits and overload answers as rooms."""

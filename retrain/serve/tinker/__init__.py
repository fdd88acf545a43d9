"""The Tinker API of `retrain serve`: its HTTP routes, the service (sessions, models, futures,
ordering, sampling) and its wire formats.
May import serve's own top (engine, errors, checkpoints), serve.door and the floors below; never
serve.openai but for the routes it mounts."""

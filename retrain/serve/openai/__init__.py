"""The OpenAI-compatible routes of `retrain serve` (routes -> wire -> models -> reply/stream).
May import serve's own top (engine, errors, checkpoints), serve.door and serve.tinker.service,
and the floors below."""

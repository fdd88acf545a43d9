"""The local backend: torch + transformers + peft in this process. `backend` (LocalBackend:
one adapter, its AdamW and RNG) over `model` (the base model loaded once); `full` (every
weight trains); `device`, `lora`, `checkpoint`; `training/` (micro-batches, the policy losses)
and `sampling/` (the exact and fast samplers, their caches, graphs and merged weights)."""

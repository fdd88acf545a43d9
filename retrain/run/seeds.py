"""Seeds derived from the run's one seed, so resume and re-evaluation need no saved stream."""

from __future__ import annotations

import hashlib


def derive_seed(seed: int, step: int, purpose: str) -> int:
    """A 63-bit seed for one purpose at one step: resume needs no saved RNG stream."""
    digest = hashlib.sha256(f"retrain:{seed}:{step}:{purpose}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def keyed_seeds(seed: int, keys: range | list[int]) -> tuple[int, ...]:
    """The sampling seeds of a step's groups (or episodes) by their number in the whole step,
    from the step's sampling seed: a group's draws never depend on which call or rank samples
    it, nor on what shares its batch."""
    return tuple(derive_seed(seed, k, "group") for k in keys)


def heldout_episode_seeds(seed: int, n: int) -> list[int]:
    """The seeds of an environment's `n` held-out episodes (the trainer's and `retrain eval`'s)."""
    return [derive_seed(seed, 0, f"eval-episode:{i}") for i in range(n)]

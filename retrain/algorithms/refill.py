"""Dynamic sampling with refill: which groups carry signal, how many more to draw, and the
advantages of the groups kept for training (pure).

A group whose (shaped) rewards are all equal has zero advantages under every group-relative
estimator, so it teaches nothing; with `training.refill` the trainer drops such groups and
samples `batch_size - groups with signal` more prompts, round after round, until the batch is
full or `max_refill_rounds` rounds were drawn (DAPO's dynamic sampling, verl's
`filter_groups`). The advantages are then computed over the kept groups only, so a batch-level
std (grpo with std_scale = "batch", reinforce_pp) sees the batch that trains.
"""

from __future__ import annotations

from retrain.algorithms.advantages import compute_advantages, is_uniform


def signal(rewards: list[list[float]], dropped: list[bool]) -> list[bool]:
    """Whether each group can train: not dropped (an environment error) and not uniform."""
    return [not d and not is_uniform(g) for g, d in zip(rewards, dropped, strict=True)]


def to_draw(with_signal: int, batch_size: int, rounds: int, max_rounds: int) -> int:
    """Groups to sample in the next refill round (0: the batch is full or rounds ran out)."""
    if rounds >= max_rounds:
        return 0
    return max(0, batch_size - with_signal)


def kept_advantages(rewards: list[list[float]], keep: list[bool], method: str,
                    std_scale: str) -> list[list[float]]:
    """Advantages of the kept groups (computed over them alone); zeros for the others."""
    kept = compute_advantages([g for g, k in zip(rewards, keep, strict=True) if k], method,
                              std_scale)
    it = iter(kept)
    return [next(it) if k else [0.0] * len(g) for g, k in zip(rewards, keep, strict=True)]

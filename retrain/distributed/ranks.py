"""Where this process stands in a torchrun group, read from the variables torch's elastic
launcher sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
None of them set: a single process, today's run. Pure: reads the mapping it is given."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from retrain.errors import UserError

# What a process of a group needs; torchrun sets all of them (and a few more).
NEEDED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world: int
    local_rank: int
    local_world: int

    @property
    def leader(self) -> bool:
        return self.rank == 0


def rank_env(env: Mapping[str, str]) -> RankEnv | None:
    """This process's place in its group; None: not started as part of one (or a group of
    one, which is the single-process run). A half-set environment is a UserError."""
    present = [k for k in NEEDED if env.get(k, "") != ""]
    if not present:
        return None
    missing = [k for k in NEEDED if k not in present]
    if missing:
        raise UserError(f"the torchrun environment is half set: {', '.join(present)} set but "
                        f"{', '.join(missing)} not; start the ranks with torchrun (it sets "
                        "them all), or unset them for a single process")
    try:
        rank, world, local = (int(env[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", "") or world)
    except ValueError:
        raise UserError("the torchrun environment holds a non-integer RANK, WORLD_SIZE, "
                        "LOCAL_RANK or LOCAL_WORLD_SIZE; start the ranks with torchrun") from None
    if world < 1 or not 0 <= rank < world or not 0 <= local < max(1, local_world):
        raise UserError(f"the torchrun environment is inconsistent: RANK={rank}, "
                        f"WORLD_SIZE={world}, LOCAL_RANK={local}; start the ranks with "
                        "torchrun")
    return None if world == 1 else RankEnv(rank, world, local, local_world)

"""The judge's budget in a campaign: `[reward.judge] max_concurrent` slots shared by every run,
held through the same mechanism as the campaign's API budget, beside it:

- the local executor: a file semaphore in `<campaign>/judge_slots/`, next to the API slots
  folder that $RETRAIN_API_SLOTS names;
- the Ray executor: a second named slot actor, `judge-<API slot actor>`, that the executor
  creates next to the API one (`prepare`) and removes with it (`close`), so runs on every
  node share one budget.

A worker finds it from $RETRAIN_API_SLOTS alone (no second variable to forward to the
nodes); a standalone run has none (None: the judge then caps its own requests).
"""

from __future__ import annotations

import os
from pathlib import Path

from retrain.slots.file_slots import ENV_VAR, RAY_PREFIX, CountingSemaphore
from retrain.slots.semaphore import SlotSemaphore

JUDGE_SLOTS_DIR = "judge_slots"   # beside the campaign's API slots folder
JUDGE_ACTOR_PREFIX = "judge-"     # before the API slot actor's name


def judge_actor_name(api_actor: str) -> str:
    """The Ray actor holding a campaign's judge budget, named after its API slot actor."""
    return JUDGE_ACTOR_PREFIX + api_actor


def judge_slots_from_env(max_concurrent: int) -> SlotSemaphore | None:
    """The campaign's judge budget named by $RETRAIN_API_SLOTS; None for a standalone run."""
    where = os.environ.get(ENV_VAR, "").strip().rpartition(":")[0]
    if not where:
        return None
    if where.startswith(RAY_PREFIX):
        from retrain.slots.ray_slots import RaySlots  # only Ray campaigns pay for importing ray

        return RaySlots(judge_actor_name(where[len(RAY_PREFIX):]), max_concurrent)
    return CountingSemaphore(Path(where).parent / JUDGE_SLOTS_DIR, max_concurrent)

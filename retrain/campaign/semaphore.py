"""Moved to `retrain.slots` (the ground-floor slots module); kept so old imports still work."""

from retrain.slots import (  # noqa: F401
    ENV_VAR,
    CountingSemaphore,
    NoSlots,
    env_value,
    slots_from_env,
    slots_in_use,
)

"""The `python` kind: the user's own Environment, `factory = "file.py:Class"` or
`"module:function"` (relative to the config file's folder), called with [environment.params]."""

from __future__ import annotations

import inspect

from retrain.config.sections import EnvironmentConfig
from retrain.environments.kinds import Factory, KindContext
from retrain.environments.protocol import Environment
from retrain.environments.rewards import load_custom
from retrain.errors import UserError

_EXAMPLE = "e.g. factory = \"my_env.py:MyEnv\" (a class with reset(seed) and step(reply))"


def build(cfg: EnvironmentConfig, ctx: KindContext) -> Factory:
    if not cfg.factory:
        raise UserError(f"environment.kind = 'python' needs environment.factory; {_EXAMPLE}")
    make = load_custom(cfg.factory, ctx.config_dir, key="environment.factory")
    params = dict(cfg.params)
    where = f"environment.factory = {cfg.factory!r}"
    try:
        inspect.signature(make).bind(**params)
    except TypeError as exc:
        raise UserError(f"{where} cannot be called with [environment.params] "
                        f"{sorted(params)}: {exc}") from None
    except ValueError:
        pass  # no signature to check (a builtin)
    first = _call(make, params, where)  # fail now, with one line, not inside the first step
    if not callable(getattr(first, "reset", None)) or not callable(getattr(first, "step", None)):
        raise UserError(f"{where} made a {type(first).__name__}, which has no reset(seed) and "
                        f"step(reply); subclass retrain.environments.Environment")
    return lambda: _call(make, params, where)


def _call(make, params: dict, where: str) -> Environment:
    try:
        return make(**params)
    except Exception as exc:
        raise UserError(f"{where}: building the environment failed: "
                        f"{type(exc).__name__}: {exc}") from None

"""The back-pressure controller's state as a JSON-able dict and back: what a resumed run needs
to continue with the same fit and decisions.

Pure: no torch, no I/O (the trainer keeps the dict in state.json). `save` and `load` read and
set the fields of `ctl`, a `BackpressureController` (not imported: it imports this module).
"""

from __future__ import annotations

from retrain.control import drift
from retrain.control.oom_ceiling import OomCeiling
from retrain.control.roofline import is_positive
from retrain.control.usl import UslFit
from retrain.control.work import WorkModel

VERSION = 1


def save(ctl) -> dict:
    """The enabled controller's whole state (`BackpressureController.state_dict`)."""
    fit = ctl._fit
    ceiling = ctl.oom_ceiling
    return {"version": VERSION, "group_size": ctl.group_size, "steps": ctl._steps,
            "sums": ctl._sums.state_dict(),
            "fit": [fit.sigma, fit.kappa, fit.lam] if fit else None,
            "ceiling": ceiling.failed, "ok_max": ceiling.ok_max,
            "exploring": ctl._exploring, "explore_n": ctl._explore_n,
            "explore_len": ctl._explore_len, "retries": ctl._retries,
            "probes": list(ctl._planned), "checked": ctl._checked, "refines": ctl._refines,
            "ceiling_ok": ctl._ceiling_ok,
            "refit_left": ctl._refit_left, "land": ctl._land,
            "approaching": ctl._approaching, **ctl._watch.state_dict(),
            "noise_scale": ctl._noise_scale, "regime": ctl._regime, "next": ctl._next,
            "work": ctl._work.state_dict()}


def load(ctl, d: dict) -> None:
    """Set `ctl` from `save`'s dict (this version's or the previous one's); raises KeyError,
    TypeError or ValueError on a broken one."""
    def optional_int(v: object) -> int | None:
        return None if v is None else int(v)

    ctl._sums.load_state_dict(d["sums"])
    ctl._fit = UslFit(*map(float, d["fit"])) if d["fit"] else None
    ctl._steps = int(d["steps"])
    ctl.oom_ceiling = OomCeiling(optional_int(d["ceiling"]), optional_int(d["ok_max"]))
    ctl._next = optional_int(d["next"])
    ctl._exploring = bool(d["exploring"])
    ctl._explore_n, ctl._explore_len = int(d["explore_n"]), int(d["explore_len"])
    ctl._retries = int(d["retries"])
    # States saved before the warm-up plan was kept have [] there: the warm-up sweep.
    ctl._planned = [int(v) for v in d["probes"]] or ctl._warmup_plan()
    ctl._checked = bool(d.get("checked", False))
    ctl._refines = int(d.get("refines", 0))
    ctl._ceiling_ok = bool(d.get("ceiling_ok", False))
    ctl._refit_left = int(d["refit_left"])
    ctl._approaching = bool(d.get("approaching", False))
    ctl._land = bool(d.get("land", False))
    ctl._watch = drift.DriftWatch.from_state(d)
    ctl._work = WorkModel.from_state(d.get("work"))
    scale = d.get("noise_scale")
    ctl._noise_scale = float(scale) if is_positive(scale) else None
    ctl._regime = str(d["regime"])

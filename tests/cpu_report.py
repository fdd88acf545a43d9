"""CPU seconds per test beside pytest's wall-clock `--durations`: on a two-core machine with
three workers the wall clock says how crowded the machine was, the CPU what a test costs.

Each phase (setup, call, teardown) counts its worker's own CPU and that of the subprocesses
it waited for, tests/warm.py's included; Ray actors (children of the raylet) and servers still
running are not counted. Shown with `--durations=N` (make test), as the N most expensive tests
and the total.
"""

from __future__ import annotations

import resource
from collections import Counter, defaultdict

import pytest

from tests import warm  # its processes are the zygote's children, not the worker's

KEY, WARM = "cpu_s", "warm"
_totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # (worker, subprocesses)
_warm: Counter = Counter()   # tests/warm.py's launches: forked, cold, zygotes started
_cold: Counter = Counter()   # the tests whose launches started cold, and how many each


def _cpu_s() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime + warm.CPU_S[0]


def _measured(item):
    (own, kids), launched = _cpu_s(), dict(warm.COUNTS)
    yield
    now_own, now_kids = _cpu_s()
    item.user_properties.append((KEY, (now_own - own, now_kids - kids)))
    item.user_properties.append((WARM, {k: n - launched[k] for k, n in warm.COUNTS.items()}))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _measured(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _measured(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _measured(item)


def pytest_runtest_logreport(report) -> None:
    """Runs where the reports arrive (the xdist controller): the phase's own entry only, as
    a report carries the entries of the phases before it too."""
    phases = [v for k, v in report.user_properties if k == KEY]
    if phases:
        total = _totals[report.nodeid]
        total[0] += phases[-1][0]
        total[1] += phases[-1][1]
        launched = [v for k, v in report.user_properties if k == WARM][-1]
        _warm.update(launched)
        if launched["cold"]:
            _cold[report.nodeid] += launched["cold"]


def pytest_terminal_summary(terminalreporter, config) -> None:
    n = config.getoption("durations", None)
    if not n or not _totals:
        return
    tr = terminalreporter
    own, kids = (sum(t[i] for t in _totals.values()) for i in (0, 1))
    tr.write_sep("=", f"most CPU: {n} of {len(_totals)} tests; in all {own + kids:.0f} s "
                      f"({own:.0f} s in pytest workers, {kids:.0f} s in their subprocesses)")
    tr.write_line(f"tests/warm.py: {_warm['forked']} `python -m retrain` processes forked from "
                  f"{_warm['zygotes']} zygotes, {_warm['cold']} started cold"
                  + (f" (in {', '.join(sorted(_cold))})" if _cold else ""))
    tr.write_line("     all   worker  subprocesses")
    for nodeid, (o, k) in sorted(_totals.items(), key=lambda kv: -sum(kv[1]))[:n]:
        tr.write_line(f"{o + k:7.1f}s {o:7.1f}s {k:7.1f}s  {nodeid}")

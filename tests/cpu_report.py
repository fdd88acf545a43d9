"""CPU seconds per test beside pytest's wall-clock `--durations`: on a two-core machine with
three workers the wall clock says how crowded the machine was, the CPU what a test costs.

Each phase (setup, call, teardown) counts its worker's own CPU and that of the subprocesses
it waited for; Ray actors (children of the raylet) and servers still running are not
counted. Shown with `--durations=N` (make test), as the N most expensive tests and the total.
"""

from __future__ import annotations

import resource
from collections import defaultdict

import pytest

KEY = "cpu_s"
_totals: dict[str, float] = defaultdict(float)


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _measured(item):
    start = _cpu_s()
    yield
    item.user_properties.append((KEY, _cpu_s() - start))


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
        _totals[report.nodeid] += phases[-1]


def pytest_terminal_summary(terminalreporter, config) -> None:
    n = config.getoption("durations", None)
    if not n or not _totals:
        return
    tr = terminalreporter
    tr.write_sep("=", f"most CPU: {n} tests of {len(_totals)}, "
                      f"{sum(_totals.values()):.0f} CPU seconds in all")
    for nodeid, cpu in sorted(_totals.items(), key=lambda kv: -kv[1])[:n]:
        tr.write_line(f"{cpu:8.2f}s  {nodeid}")

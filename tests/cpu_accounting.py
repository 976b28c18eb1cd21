"""Each test's CPU, its processes' included, beside its wall time (pytest hooks, imported
by tests/conftest.py).

The suite is bound by the machine's two cores, not by waiting: a test's wall time says
how long it waited for its share of them, its CPU what it cost them. Measured from the
pytest process's own CPU and that of the processes it (or a process it reaped) waited
for, over the test's setup, call and teardown, and that of the ranks the tests' warm
standbys forked (tests/forked_ranks.py: those standbys are reaped only at the session's
end): `cpu_s` in the junit XML (var/junit-*.xml), and the tests that took the most at the
end of the run. Another process a fixture keeps beyond the test (a module's server)
counts where it is reaped; the session's control plane, reaped in the teardown of the last
test on it, is counted apart (`cpu_s_apart`, and a line of its own).
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterator

import pytest

from tests.forked_ranks import standby_pids

#: How many tests the end-of-run summary lists.
MOST = 30

_started = pytest.StashKey[float]()
_spent: list[tuple[float, str]] = []
_spent_apart: list[float] = []
_pending_apart = [0.0]  # set apart while the current test ran (one test at a time)


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime + _standbys_cpu_s()


def _standbys_cpu_s() -> float:
    """The running standbys' CPU, and that of the ranks they reaped (utime, stime, cutime
    and cstime of /proc/PID/stat)."""
    ticks = 0
    for pid in standby_pids():
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            ticks += sum(int(f) for f in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def apart() -> Iterator[None]:
    """The CPU of what runs inside is not the running test's: the session's processes it
    reaps (the control plane's, stopped in the teardown of the last test on it) are
    counted apart."""
    before = _cpu_s()
    try:
        yield
    finally:
        _pending_apart[0] += _cpu_s() - before


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_started] = _cpu_s()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    if call.when != "teardown" or _started not in item.stash:
        return
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    set_apart, _pending_apart[0] = _pending_apart[0], 0.0
    spent = _cpu_s() - item.stash[_started] - set_apart
    report.user_properties.append(("cpu_s", round(spent, 2)))
    if set_apart:
        report.user_properties.append(("cpu_s_apart", round(set_apart, 2)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # In the controller too: xdist's workers send their reports with their properties.
    if report.when == "teardown":
        for name, value in report.user_properties:
            if name == "cpu_s" and isinstance(value, float | int):
                _spent.append((float(value), report.nodeid))
            elif name == "cpu_s_apart" and isinstance(value, float | int):
                _spent_apart.append(float(value))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _spent:
        return
    total = sum(cpu for cpu, _ in _spent)
    terminalreporter.write_sep("=", f"most CPU {MOST} (processes included; {total:.0f} s in all)")
    for cpu, nodeid in sorted(_spent, reverse=True)[:MOST]:
        terminalreporter.write_line(f"{cpu:8.2f}s {nodeid}")
    if _spent_apart:
        terminalreporter.write_line(
            f"{sum(_spent_apart):8.2f}s apart: the session's control plane (its whole life)"
        )

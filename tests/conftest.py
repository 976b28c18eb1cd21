"""Shared fixtures: databases (SQLite always, PostgreSQL too) and settings; what a skip
means under CI.

PostgreSQL: `SUPERVISOR_TEST_DATABASE_URL` names a server to use as it is; without it, the
session starts a server of its own from this machine's binaries (tests/postgres.py) the
first time a test asks for one, and stops it at the end.

Under `CI=true` a test skipped for want of something CI installs (PostgreSQL, Chromium,
nftables, network namespaces, torch, the object stores...) fails instead: a missing
install step cannot pass as green. Only the skips in `CI_MAY_SKIP` stay skips.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _pytest.mark.expression import Expression  # how pytest reads `-m`
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from supervisor.config import Settings
from tests.control_plane import ControlPlane, Identity
from tests.postgres import running_postgres
from tests.session_groups import HEAVY_SESSION, PLANE_MODULES, order_of
from tests.timing import scaled

#: Each test's CPU, its processes' included (var/junit-*.xml, and the most at the end).
pytest_plugins = ("tests.cpu_accounting",)

PG_URL = os.environ.get("SUPERVISOR_TEST_DATABASE_URL")
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
#: Skips CI takes as skips: what no machine of this project's kind has.
CI_MAY_SKIP = ("an NVIDIA driver is present",)
AGENT_TOKEN = "agent-token-for-tests"
OPERATOR_TOKEN = "operator-token-for-tests"


def _pg_engine_url(url: str) -> str:
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    """The PostgreSQL server of the session: the one named, or one of its own."""
    if PG_URL:
        yield PG_URL
        return
    with running_postgres() as server:
        yield server.url


@pytest.fixture
def pg_url(pg_server_url: str) -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a fresh schema, dropped afterwards.

    A schema per test keeps concurrent runs on one database out of each other's way.
    """
    base = _pg_engine_url(pg_server_url)
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """Each test using this runs on SQLite and, when configured, on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/supervisor.db"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture
def sqlite_url(tmp_path: Any) -> str:
    return f"sqlite:///{tmp_path}/supervisor.db"


SettingsFactory = Callable[..., Settings]


#: The session's control plane (when a test asked for one), and the last test to use it:
#: once that test is done the plane stops, not left idling for the rest of the session.
_planes: list[ControlPlane] = []
_last_plane_test: list[str] = []


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """The real Kubernetes control plane (tests/control_plane.py), started the first time
    a test of the session asks for it, stopped after the last: each test keeps to its own
    nodes and objects."""
    plane = ControlPlane(tmp_path_factory.mktemp("control-plane"))
    _planes.append(plane)
    try:
        plane.start(within=scaled(120))
        yield plane
    finally:
        _stop_planes()


def _stop_planes() -> None:
    """Stop the session's control plane (idempotent), its CPU counted apart from the test
    in whose teardown it ends."""
    from tests.cpu_accounting import apart  # registered as a plugin: imported by then

    with apart():
        for plane in _planes:
            plane.stop()


@pytest.fixture(scope="session")
def kube_supervisor(control_plane: ControlPlane) -> Identity:
    """The supervisor's identity on the real control plane: the chart's ServiceAccount
    (its RBAC applied as Helm renders it), for the workload namespace `default`."""
    from tests.chart_rbac import chart_identity  # renders the chart: only when asked for

    return chart_identity(control_plane, "default")


@pytest.fixture
def make_settings(sqlite_url: str) -> SettingsFactory:
    """Settings for tests: known tokens, fault injection on, fast timeouts."""

    def build(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "database_url": sqlite_url,
            "agent_token": AGENT_TOKEN,
            "operator_token": OPERATOR_TOKEN,
            "enable_fault_injection": True,
            "heartbeat_polling_period_s": 0.1,
            "heartbeat_timeout_s": 0.5,
            "action_retry_backoff_s": 0.01,
        }
        values.update(overrides)
        return Settings(**values)

    return build


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    if not (CI and report.skipped) or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)
    if not any(allowed in reason for allowed in CI_MAY_SKIP):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, where its parts are installed: {reason}"


#: The modules `make check` runs (`-m fast`): they start no process and no server of their
#: own (the PostgreSQL runs of the store tests aside), so the inner loop takes minutes.
FAST_MODULES = frozenset(
    {
        "test_action_transitions",
        "test_agent_time",
        "test_api",
        "test_backoff",
        "test_bench_chaos_account",
        "test_bench_kube_requests",
        "test_budget",
        "test_checkpoint_failures",
        "test_checkpoint_retention",
        "test_contracts",
        "test_deadlines",
        "test_docs",
        "test_durable_interval",
        "test_exception_roots",
        "test_fault_marks",
        "test_fault_table",
        "test_goodput",
        "test_goodput_history",
        "test_helm_chart",
        "test_helm_monitoring",
        "test_helm_relay",
        "test_host_monitor_config",
        "test_host_monitor_metrics",
        "test_host_monitor_nvml",
        "test_host_monitor_peer",
        "test_host_monitor_standby",
        "test_host_monitor_watchdogs",
        "test_host_monitor_worlds",
        "test_incidents",
        "test_job_end",
        "test_job_metrics",
        "test_kube_errors",
        "test_kube_journal",
        "test_leader_epochs",
        "test_loader",
        "test_local_ports",
        "test_local_preload",
        "test_module_size",
        "test_node_status",
        "test_numpy_fencing",
        "test_partitions_fencing",
        "test_peer_data_plane",
        "test_peer_worlds",
        "test_policies",
        "test_protocol_bodies",
        "test_protocol_emergency",
        "test_retention",
        "test_schedules",
        "test_sensor",
        "test_sensor_peer_cuts",
        "test_sensor_snapshot",
        "test_spelled_names",
        "test_store",
        "test_torchrun_flags",
    }
)


#: The modules that train with several torch processes at once: they take the machine's
#: cores. `make test` runs them (`-m heavy`) in a session of their own, beside a second
#: session that runs every other module, two at a time at most (HEAVY_GROUPS in
#: tests/session_groups.py): more side by side pushed a 2-core machine's load past 8 and
#: broke their timing margins. That session's workers then run a few modules that mostly
#: wait (HEAVY_SESSION_FILL), so that both sessions end together.
HEAVY_MODULES = frozenset[str]().union(*HEAVY_SESSION.values())


#: The modules that measure the service at fleet scale (2,000 nodes heartbeating against
#: their heartbeat timeout): `make test` runs them (`-m solo`) alone, before the two
#: sessions. Beside the torch training, the supervisor fell behind the fleet's 400
#: heartbeats a second, declared early nodes lost, and their return cost more again.
SOLO_MODULES = frozenset({"test_dashboard_fleet"})


def _module(item: pytest.Item) -> str:
    module = getattr(item, "module", None)
    return module.__name__.rsplit(".", 1)[-1] if module is not None else item.nodeid


#: Each mark the lists above give a whole module's tests.
MODULE_MARKS = {"fast": FAST_MODULES, "heavy": HEAVY_MODULES, "solo": SOLO_MODULES}


def _module_marks(name: str) -> set[str]:
    return {mark for mark, modules in MODULE_MARKS.items() if name in modules}


def pytest_itemcollected(item: pytest.Item) -> None:
    for mark in _module_marks(_module(item)):
        item.add_marker(getattr(pytest.mark, mark))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A test module none of whose tests a `-m` of the marks above selects is not even
    imported: each of `make test`'s sessions and `make check` imported every module to
    deselect most of them (torch, the service, the plane's helpers: about 20 s of CPU in
    each worker). Any other `-m` (a mark of pytest's, a parameter's) leaves it to pytest."""
    expression = config.getoption("markexpr")
    if not expression or not collection_path.name.startswith("test_"):
        return None
    if collection_path.suffix != ".py":
        return None
    if not set(re.findall(r"\w+", expression)) <= {"and", "or", "not", "(", ")", *MODULE_MARKS}:
        return None
    marks = _module_marks(collection_path.stem)
    selected = Expression.compile(expression).evaluate(lambda name, **_: name in marks)
    return None if selected else True


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup`: the modules grouped as tests/session_groups.py says."""
    if config.getoption("dist") != "loadgroup":
        return None
    from tests.session_groups import GroupScheduling  # xdist: only where it schedules

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long groups first (tests/session_groups.py), each module's tests together and in
    their order; a module on the control plane must be listed as one."""
    on_plane = {_module(i) for i in items if "control_plane" in getattr(i, "fixturenames", ())}
    if on_plane - PLANE_MODULES:
        raise pytest.UsageError(
            f"modules on the control plane missing from PLANE_MODULES in "
            f"tests/session_groups.py: {sorted(on_plane - PLANE_MODULES)}"
        )
    items.sort(key=lambda item: order_of(_module(item)))


def pytest_collection_finish(session: pytest.Session) -> None:
    users = [i.nodeid for i in session.items if "control_plane" in getattr(i, "fixturenames", ())]
    _last_plane_test[:] = users[-1:]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if _last_plane_test and item.nodeid == _last_plane_test[0]:
        _stop_planes()  # the fixture's own end stops it again: nothing left to do

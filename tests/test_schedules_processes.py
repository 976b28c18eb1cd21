"""Schedules outlive the supervisor's process: a fault drill stored in the supervisor's
database goes on injecting after a kill -9 and a restart of `supervisor serve`, and
after a change of leader between two replicas electing one over a Lease of the fake
Kubernetes API server (tests/kube, spoken to by the real client over HTTP; the harness
is bench/failover.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench import failover
from bench.failover import Timing, pair
from tests.conftest import AGENT_TOKEN, OPERATOR_TOKEN
from tests.http import http
from tests.test_api import heartbeat
from tests.test_e2e import Server
from tests.timing import scaled

AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
DRILL = {"schedule": {"every_s": 1, "kinds": ["xid"], "job": "j1"}}


SCHEDULE = 'schedule={"every_s": 1, "kinds": ["xid"]}'


def cli(home: Path, server: Server, *args: str) -> Any:
    """`supervisor ARGS -o json` against `server`, in a clean environment; its answer."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")}
    env |= {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")}
    env |= {"SUPERVISOR_URL": server.url, "SUPERVISOR_OPERATOR_TOKEN": OPERATOR_TOKEN}
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", *args, "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    return json.loads(done.stdout)


def until(predicate: Callable[[], Any], within: float = 30.0) -> Any:
    deadline = time.monotonic() + scaled(within)
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"condition not met within {scaled(within):g} s"
        time.sleep(0.1)
    return value


def injected(url: str, drill: int, headers: dict[str, str] = OPERATOR) -> list[int]:
    """Ids of the faults the drill injected, oldest first."""
    r = http.get(f"{url}/api/v1/faults", headers=headers, timeout=10)
    r.raise_for_status()
    return sorted(f["id"] for f in r.json() if f["params"].get("schedule") == drill)


def beat(url: str, node: str, headers: dict[str, str] = AGENT) -> None:
    r = http.post(f"{url}/api/v1/heartbeats", json=heartbeat(node), headers=headers, timeout=10)
    r.raise_for_status()


def test_a_drill_and_a_window_outlive_a_kill_9_and_a_restart(tmp_path: Path) -> None:
    server = Server(
        tmp_path,
        backend="dry_run",
        heartbeat_timeout_s=60,
        heartbeat_polling_period_s=5,
        gpu_report_cooldown_s=0,
    )
    server.start()
    try:
        beat(server.url, "n1")
        # Scheduled with the operators' CLI, as an on-call engineer would.
        drill = int(
            cli(tmp_path, server, "inject", "schedule", "--param", SCHEDULE, "--job", "j1")["id"]
        )
        until(lambda: injected(server.url, drill))
        start = datetime.now(UTC) + timedelta(hours=1)
        window = {
            "node": "n1",
            "start": start.isoformat(),
            "end": (start + timedelta(hours=2)).isoformat(),
        }
        r = http.post(f"{server.url}/api/v1/maintenance", json=window, headers=OPERATOR, timeout=10)
        assert r.status_code == 201, r.text
        planned = r.json()
        server.kill()
        server.start()  # the same database
        r = http.get(f"{server.url}/api/v1/maintenance", headers=OPERATOR, timeout=10)
        assert r.json() == [planned]  # the window is still to come, as it was
        before = injected(server.url, drill)
        beat(server.url, "n1")
        after = until(lambda: [f for f in injected(server.url, drill) if f > max(before)])
        assert after, "the drill did not go on after the restart"
        r = http.delete(f"{server.url}/api/v1/faults/{drill}", headers=OPERATOR, timeout=10)
        assert r.json()["active"] is False
        stopped = injected(server.url, drill)
        time.sleep(2.5)  # more than two periods
        assert injected(server.url, drill) == stopped
    finally:
        server.stop()


TIMING = Timing(lease_duration_s=2.0, renew_deadline_s=1.5, retry_period_s=0.25)


def test_a_drill_goes_on_after_a_change_of_leader(tmp_path: Path) -> None:
    env = {"SUPERVISOR_GPU_REPORT_COOLDOWN_S": "0"}
    with pair(tmp_path, TIMING, env=env, start_timeout_s=scaled(30)) as cluster:
        leader, standby = cluster.wait_leader(scaled(30))
        beat(leader.url, "n1", failover.AGENT)
        r = http.post(
            f"{leader.url}/api/v1/faults", json=DRILL, headers=failover.OPERATOR, timeout=10
        )
        assert r.status_code == 201, r.text
        drill = r.json()["id"]
        until(lambda: injected(leader.url, drill, failover.OPERATOR))
        # The standby runs no job while it waits: it has not started its scheduler.
        assert "scheduler started" not in standby.log_text()
        leader.kill()
        until(lambda: standby.readyz()[0] == 200, within=60)
        assert "scheduler started: 1 stored jobs" in standby.log_text()
        before = injected(standby.url, drill, failover.OPERATOR)
        beat(standby.url, "n1", failover.AGENT)
        after = until(
            lambda: [f for f in injected(standby.url, drill, failover.OPERATOR) if f > max(before)]
        )
        assert after, standby.log_text()
        # The fault is committed, then the line is logged: wait for the line too.
        until(lambda: f"schedule {drill} injected xid on n1" in standby.log_text())

"""Warm standby workers of a real host monitor: started ahead with the job's modules
imported, adopted as the worker by the next start of the job's command, replaced, and
never left behind when the host monitor dies."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_host_monitor import Agent, Cluster, wait_for

COMMAND = [sys.executable, "-m", "tests.fixtures.standby_worker", "--flag"]
PRELOAD = ["tests.fixtures.standby_marker"]


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[Agent, Path]]:
    (tmp_path / "monitor").mkdir()
    out = tmp_path / "out"
    out.mkdir()
    cluster = Cluster(tmp_path / "monitor")
    monitor = cluster.start_agent(None, node="node-s", initial_state="spare")
    try:
        yield monitor, out
    finally:
        monitor.close()
        monitor.proc.kill()
        monitor.proc.wait(10)


def preloaded(out: Path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in out.glob("preloaded-*")}


def workers(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("worker-*.json"))]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_a_standby_becomes_the_worker_and_another_one_follows(agent: tuple[Agent, Path]) -> None:
    monitor, out = agent
    env = {"STANDBY_OUT": str(out), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    body = {"job": "j1", "command": COMMAND, "env": env, "preload": PRELOAD}
    r = monitor.api.post("/v1/standby", json=body)
    assert r.status_code == 200 and r.json() == {"ready": True}, r.text
    (standby,) = wait_for(lambda: preloaded(out), 30, "the standby preloaded")
    # Asked again: the same standby, not a second one.
    assert monitor.api.post("/v1/standby", json=body).json() == {"ready": True}
    time.sleep(0.5)
    assert preloaded(out) == {standby}
    start = {
        "request_id": "s1",
        "job": "j1",
        "command": COMMAND,
        "env": env,
        "workers": [{"rank": 3, "local_rank": 0}],
        "standby_preload": PRELOAD,
    }
    r = monitor.api.post("/v1/workers/start", json=start)
    assert r.status_code == 200, r.text
    (worker,) = wait_for(lambda: workers(out), 30, "the worker ran")
    # The standby itself runs the worker: its pid, its preloaded module, the rank's env.
    assert worker == {"pid": standby, "rank": "3", "preloaded": True, "argv": ["--flag"]}
    assert monitor.workers()[3]["host_pid"] == standby
    log = (monitor.log.parent / "run" / "node-s.j1.rank3.log").read_text()
    assert "worker rank=3 running" in log
    # A new standby follows, a few seconds later (not while the ranks start).
    second = wait_for(lambda: preloaded(out) - {standby}, 30, "the next standby")
    (second_pid,) = second
    # The host monitor dies: its standby goes with it, the worker stays (as a launched one
    # does).
    monitor.proc.send_signal(signal.SIGKILL)
    monitor.proc.wait(10)
    wait_for(lambda: not alive(second_pid), 10, "the standby gone with its host monitor")
    assert alive(standby)
    os.kill(standby, signal.SIGKILL)


def test_a_command_that_is_not_a_module_has_no_standby(agent: tuple[Agent, Path]) -> None:
    monitor, _ = agent
    body = {"job": "j1", "command": [sys.executable, "x.py"], "preload": PRELOAD}
    r = monitor.api.post("/v1/standby", json=body)
    assert r.status_code == 200 and r.json() == {"ready": False}
    r = monitor.api.post("/v1/standby", json={**body, "preload": []})
    assert r.status_code == 422 and "preload" in r.text

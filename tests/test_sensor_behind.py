"""A supervisor that ran behind declares no node lost whose heartbeat sat in its own queue.

When the supervisor stalls (paused, starved of CPU, a slow commit) past its nodes'
heartbeat deadlines, the deadlines fire as soon as it runs again, before the heartbeats
that queued meanwhile are read: each such loss is looked at again once they are, and
only a node that sent nothing is lost. First on the sensor alone, its event loop blocked;
then `supervisor serve` as a process, stopped with SIGSTOP while nodes keep sending.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import httpx

from supervisor.domain import EventType
from tests.test_api import heartbeat
from tests.test_host_monitor import AGENT_TOKEN, Supervisor
from tests.test_sensor import SensorFactory, make_sensor, now, stepping, types, until
from tests.timing import scaled

__all__ = ["make_sensor"]  # the fixture, used by name


async def test_a_deadline_passed_while_the_loop_was_blocked_waits_for_the_queued_heartbeat(
    make_sensor: SensorFactory,
) -> None:
    sensor, emitted = make_sensor(heartbeat_timeout_s=0.3, heartbeat_polling_period_s=0.05)
    sensor.ingest(stepping("kept", 1))
    sensor.ingest(stepping("gone", 1, ranks=(1,)))
    loop = asyncio.get_running_loop()
    due = now() + 0.3
    # "kept" sent its next heartbeat just after its deadline: it waits in the queue (a
    # timer due after the deadline's, as a request read only after the loop ran again).
    loop.call_at(due + 0.01, sensor.ingest, stepping("kept", 2))
    time.sleep(0.8)  # noqa: ASYNC251 (the point: the loop blocked past both deadlines)
    await asyncio.sleep(0)  # the timers due run, then the queued heartbeat

    async def keeps_beating() -> None:
        for step in range(3, 1000):
            await asyncio.sleep(0.05)
            sensor.ingest(stepping("kept", step))

    beating = asyncio.create_task(keeps_beating())
    try:
        await until(lambda: bool(emitted.events), patience=5)
        await asyncio.sleep(0.4)  # past any second look
    finally:
        beating.cancel()
    assert [(e.type, e.node) for e in emitted.events] == [(EventType.HOST_HEARTBEAT_LOST, "gone")]
    # Told how late it was from its own deadline, not from the second look.
    assert emitted.events[0].details["lateness_ms"] >= 500
    assert sensor.metrics.losses_deferred._value.get() == 2
    assert types(emitted.events) == [EventType.HOST_HEARTBEAT_LOST]


async def test_a_deadline_met_on_time_is_not_looked_at_twice(make_sensor: SensorFactory) -> None:
    sensor, emitted = make_sensor(heartbeat_timeout_s=0.2, heartbeat_polling_period_s=0.05)
    sensor.ingest(stepping("n1", 1))
    await until(lambda: bool(emitted.events), patience=5)
    assert types(emitted.events) == [EventType.HOST_HEARTBEAT_LOST]
    assert sensor.metrics.losses_deferred._value.get() == 0


class Beating:
    """Nodes that each send a heartbeat, wait for its answer, and send the next a period
    later, as host monitors do, each on its own connection."""

    def __init__(self, url: str, nodes: list[str], period_s: float) -> None:
        self.stop = threading.Event()
        self.sent = dict.fromkeys(nodes, 0)
        self.errors: list[str] = []
        self._threads = [
            threading.Thread(target=self._beat, args=(url, node, period_s), daemon=True)
            for node in nodes
        ]
        for thread in self._threads:
            thread.start()

    def _beat(self, url: str, node: str, period_s: float) -> None:
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {AGENT_TOKEN}"}, timeout=60
        ) as client:
            while not self.stop.is_set():
                body = heartbeat(node, job=None)
                try:
                    response = client.post("/api/v1/heartbeats", json=body)
                    if response.status_code not in (202, 204):
                        self.errors.append(f"{node}: {response.status_code} {response.text}")
                except httpx.HTTPError as exc:
                    self.errors.append(f"{node}: {exc!r}")
                self.sent[node] += 1
                self.stop.wait(period_s)

    def close(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(10)


def test_a_supervisor_stopped_past_the_timeout_declares_only_the_silent_node_lost(
    tmp_path: Path,
) -> None:
    server = Supervisor(tmp_path, env={"SUPERVISOR_HEARTBEAT_TIMEOUT_S": "1"})
    server.start()
    assert server.proc is not None
    nodes = [f"n{i}" for i in range(8)]
    beating = Beating(server.url, nodes, period_s=0.1)
    silent = Beating(server.url, ["silent"], period_s=0.1)
    try:
        deadline = time.monotonic() + scaled(20)
        while not all(server.node(n) for n in [*nodes, "silent"]):
            assert time.monotonic() < deadline, ("the nodes were not heard", beating.errors[:3])
            time.sleep(0.1)
        silent.close()  # stops sending, and the supervisor is stopped at once
        os.kill(server.proc.pid, signal.SIGSTOP)
        time.sleep(3.0)  # three heartbeat timeouts: every node's deadline passes
        os.kill(server.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + scaled(20)
        while not server.events("silent", "host_heartbeat_lost"):
            assert time.monotonic() < deadline, "the silent node was not declared lost"
            time.sleep(0.1)
        time.sleep(2.0)  # two more timeouts of steady heartbeats
        lost = server.http.get("/api/v1/events", params={"type": "host_heartbeat_lost"})
        assert [e["node"] for e in lost.json()["items"]] == ["silent"]
        assert beating.errors == []
        metrics = server.http.get("/metrics").text
        (line,) = [
            ln
            for ln in metrics.splitlines()
            if ln.startswith("supervisor_node_losses_deferred_total")
        ]
        assert float(line.rsplit(" ", 1)[1]) >= 1, line
        assert "ran" in server.log.read_text() and "behind its heartbeat deadlines" in (
            server.log.read_text()
        )
    finally:
        beating.close()
        silent.close()
        if server.proc is not None:
            os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()

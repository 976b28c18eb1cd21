"""Heartbeats in batches: host monitors -> `host-monitor relay` -> `supervisor serve`.

Real processes over HTTP. The supervisor takes node credentials only (`agent_auth
node_key`), so each node speaks only for itself: the relay carries heartbeats with its
own credential, and each heartbeat with its node's. A relay cannot speak for a node
whose credential it does not hold (that entry refused alone, the others taken); a batch
past its bound is refused naming the field; and when the relay dies, the host monitors
send directly, so no node is declared lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from resiliency_protocol.heartbeat_batch import MAX_BATCH, encode_batch
from supervisor.identity.node_keys import node_credential
from supervisor.local.cluster_state import free_port
from tests.http import http
from tests.test_host_monitor import NODE_KEY, Cluster, Supervisor, wait_for
from tests.timing import scaled

BATCH = "/api/v1/heartbeats/batch"


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    server = Supervisor(tmp_path, env={"SUPERVISOR_AGENT_AUTH": "node_key"})
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.teardown()


class Relay:
    """`host-monitor relay` as a process, with its own credential (a node credential of
    the host it runs on)."""

    def __init__(self, tmp: Path, supervisor_url: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.credential = node_credential(NODE_KEY, "relay-host")
        path = tmp / "relay.credential"
        path.write_text(self.credential)
        self.log = tmp / "relay.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOST_MONITOR_")}
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "host_monitor.cli", "relay"),
                    *("--supervisor-url", supervisor_url, "--host", "127.0.0.1"),
                    *("--port", str(self.port), "--credential-file", str(path)),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for(self._up, 15, "relay listening")

    def _up(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            return http.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def counts(self) -> dict[str, Any]:
        return http.get(f"{self.url}/healthz", timeout=2).json()  # type: ignore[no-any-return]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)


@pytest.fixture
def relay(tmp_path: Path, supervisor: Supervisor) -> Iterator[Relay]:
    started = Relay(tmp_path, supervisor.url)
    try:
        yield started
    finally:
        started.kill()


def _agents(cluster: Cluster, supervisor: Supervisor, relay: Relay, count: int) -> list[str]:
    """`count` host monitors, each with only its own credential, beating through `relay`."""
    nodes = [f"hm-{uuid.uuid4().hex[:8]}" for _ in range(count)]
    for node in nodes:
        cluster.start_agent(
            supervisor.url,
            node=node,
            heartbeat_relay_url=relay.url,
            env={
                "HOST_MONITOR_AGENT_TOKEN": "",
                "HOST_MONITOR_NODE_CREDENTIAL": node_credential(NODE_KEY, node),
            },
        )
    return nodes


def _alive(supervisor: Supervisor, nodes: list[str]) -> bool:
    return all((n := supervisor.node(node)) is not None and n["alive"] for node in nodes)


def test_host_monitors_beat_through_a_relay_and_beat_directly_once_it_is_gone(
    supervisor: Supervisor, relay: Relay, cluster: Cluster
) -> None:
    nodes = _agents(cluster, supervisor, relay, 3)
    wait_for(lambda: _alive(supervisor, nodes), 15, "the nodes alive at the supervisor")
    # Several periods: every heartbeat through the relay, in batches.
    wait_for(lambda: relay.counts()["heartbeats"] >= 3 * 5, 15, "heartbeats relayed")
    counts = relay.counts()
    assert counts["batches"] < counts["heartbeats"]

    relay.kill()
    # Three heartbeat timeouts (1 s each) with the relay gone: no node lost.
    time.sleep(scaled(3.0))
    assert _alive(supervisor, nodes)
    for node in nodes:
        assert supervisor.events(node, "host_heartbeat_lost") == []


def test_a_relay_speaks_for_no_node_whose_credential_it_does_not_hold(
    supervisor: Supervisor, relay: Relay
) -> None:
    own = f"hm-{uuid.uuid4().hex[:8]}"
    body = encode_batch(
        [
            # A node's own heartbeat with its own credential: taken.
            (node_credential(NODE_KEY, own), b'{"node":"%s","state":"spare"}' % own.encode()),
            # Another node's heartbeat with the relay's own credential: refused alone.
            (relay.credential, b'{"node":"victim","state":"spare"}'),
            # A forged credential: refused alone.
            ("node.victim." + "A" * 43, b'{"node":"victim","state":"spare"}'),
            # A bad heartbeat: refused alone, naming its field.
            (node_credential(NODE_KEY, own), b'{"node":"%s","state":"asleep"}' % own.encode()),
        ]
    )
    headers = {"Authorization": f"Bearer {relay.credential}", "Content-Type": "application/json"}
    r = http.post(f"{supervisor.url}{BATCH}", content=body, headers=headers)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    # The node's first heartbeat registers it: an event, as the single route answers.
    assert [result["status"] for result in results] == [202, 403, 401, 422]
    assert set(results[0]["body"]) == {"events"}
    assert results[1]["body"]["message"] == (
        "node: 'victim' is not the node of this credential ('relay-host')"
    )
    assert results[3]["body"]["message"].startswith("state: ")
    assert supervisor.node(own) is not None
    assert supervisor.node("victim") is None

    # The relay's own credential is required, and a batch is bounded.
    r = http.post(f"{supervisor.url}{BATCH}", content=body, headers={"Authorization": "Bearer x"})
    assert r.status_code == 401
    spare = (node_credential(NODE_KEY, own), b'{"node":"%s","state":"spare"}' % own.encode())
    r = http.post(
        f"{supervisor.url}{BATCH}", content=encode_batch([spare] * (MAX_BATCH + 1)), headers=headers
    )
    assert r.status_code == 422
    assert r.json()["message"] == f"heartbeats: at most {MAX_BATCH} heartbeats in a batch"


async def test_the_relay_answers_each_heartbeat_as_the_supervisor_would(
    supervisor: Supervisor, relay: Relay
) -> None:
    """Heartbeats sent to the relay at once travel in one batch; each sender gets the
    supervisor's answer to its own: taken, refused for another node's credential, or
    refused by the relay itself for a body that is not JSON (which would spoil the batch)."""
    own = f"hm-{uuid.uuid4().hex[:8]}"
    url = f"{relay.url}/api/v1/heartbeats"

    def sent(credential: str, body: bytes) -> dict[str, Any]:
        return {"content": body, "headers": {"Authorization": f"Bearer {credential}"}}

    spare = b'{"node":"%s","state":"spare"}' % own.encode()
    async with httpx.AsyncClient(timeout=scaled(10)) as client:
        taken, other, broken = await asyncio.gather(
            client.post(url, **sent(node_credential(NODE_KEY, own), spare)),
            client.post(url, **sent(node_credential(NODE_KEY, "n-else"), spare)),
            client.post(url, **sent(node_credential(NODE_KEY, own), b'{"node":')),
        )
        again = await client.post(url, **sent(node_credential(NODE_KEY, own), spare))
    assert taken.status_code == 202 and set(taken.json()) == {"events"}
    assert other.status_code == 403
    assert other.json()["message"] == f"node: {own!r} is not the node of this credential ('n-else')"
    assert broken.status_code == 422 and "invalid JSON" in broken.json()["message"]
    assert again.status_code == 204  # nothing changed: the single route's 204
    assert relay.counts()["heartbeats"] == 3

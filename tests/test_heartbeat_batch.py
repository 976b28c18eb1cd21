"""Heartbeats in batches: host monitors -> `host-monitor relay` -> `supervisor serve`.

Real processes over HTTP. The supervisor takes node credentials only (`agent_auth
node_key`), so each node speaks only for itself: the relay carries heartbeats with its
own credential, and each heartbeat with its node's. A relay cannot speak for a node
whose credential it does not hold (that entry refused alone, the others taken); a batch
past its bound is refused naming the field; and when the relay dies, the host monitors
send directly, so no node is declared lost. Given a certificate (from a CA made here,
trustme) the relay serves HTTPS: a host monitor whose CA did not issue it sends directly
too, and TLS flags it cannot serve with stop it at start.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

from host_monitor.relay import HeartbeatRelay
from resiliency_protocol.heartbeat import URGENT_HEADER
from resiliency_protocol.heartbeat_batch import MAX_BATCH, encode_batch
from resiliency_protocol.tls import client_context
from supervisor.identity.node_keys import node_credential
from supervisor.local.ports import free_port
from tests.http import http
from tests.test_host_monitor import NODE_KEY, Agent, Cluster, Supervisor, wait_for
from tests.timing import scaled, wait_until_async

BATCH = "/api/v1/heartbeats/batch"
VERIFY_FAILED = "CERTIFICATE_VERIFY_FAILED"


@dataclass(frozen=True)
class Rack:
    """The supervisor, taking node credentials only (each node speaks only for itself),
    and the host monitors started beside it."""

    supervisor: Supervisor
    cluster: Cluster


@pytest.fixture
def rack(tmp_path: Path) -> Iterator[Rack]:
    with contextlib.ExitStack() as stack:
        supervisor = Supervisor(tmp_path, env={"SUPERVISOR_AGENT_AUTH": "node_key"})
        stack.callback(supervisor.stop)
        supervisor.start()
        cluster = Cluster(tmp_path)
        stack.callback(cluster.teardown)
        yield Rack(supervisor, cluster)


@dataclass(frozen=True)
class Certificate:
    """A certificate for 127.0.0.1, its key, and the CA that issued it (PEM files)."""

    cert: Path
    key: Path
    ca: Path


def issued(tmp: Path, name: str) -> Certificate:
    """A certificate for 127.0.0.1 from a CA of its own, made here (trustme)."""
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    paths = Certificate(tmp / f"{name}.crt", tmp / f"{name}.key", tmp / f"{name}-ca.crt")
    issued.cert_chain_pems[0].write_to_path(str(paths.cert))
    issued.private_key_pem.write_to_path(str(paths.key))
    ca.cert_pem.write_to_path(str(paths.ca))
    return paths


def relay_command(supervisor_url: str, *flags: str) -> list[str]:
    return [
        *(sys.executable, "-m", "host_monitor.cli", "relay", "--host", "127.0.0.1"),
        *("--supervisor-url", supervisor_url, *flags),
    ]


class Relay:
    """`host-monitor relay` as a process, with its own credential (a node credential of
    the host it runs on); over HTTPS with `certificate`. Killed on leaving `with`."""

    def __init__(self, tmp: Path, supervisor_url: str, certificate: Certificate | None = None):
        self.port = free_port()
        self.credential = node_credential(NODE_KEY, "relay-host")
        path = tmp / f"relay-{self.port}.credential"
        path.write_text(self.credential)
        flags = ["--port", str(self.port), "--credential-file", str(path)]
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = http
        if certificate is not None:
            flags += ["--tls-cert-file", str(certificate.cert)]
            flags += ["--tls-key-file", str(certificate.key)]
            self.url = f"https://127.0.0.1:{self.port}"
            self.http = httpx.Client(timeout=5, verify=client_context(certificate.ca))
        self.log = tmp / f"relay-{self.port}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOST_MONITOR_")}
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                relay_command(supervisor_url, *flags),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def __enter__(self) -> Relay:
        try:
            wait_for(self._up, 15, "relay listening")
        except BaseException:
            self.kill()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def _up(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            return self.http.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def counts(self) -> dict[str, Any]:
        return self.http.get(f"{self.url}/healthz", timeout=2).json()  # type: ignore[no-any-return]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)
        if self.http is not http:
            self.http.close()


@pytest.fixture
def relay(tmp_path: Path, rack: Rack) -> Iterator[Relay]:
    with Relay(tmp_path, rack.supervisor.url) as started:
        yield started


def _agents(rack: Rack, relay: Relay, count: int, **flags: Any) -> list[Agent]:
    """`count` host monitors, each with only its own credential, beating through `relay`."""
    return [
        rack.cluster.start_agent(
            rack.supervisor.url,
            node=(node := f"hm-{uuid.uuid4().hex[:8]}"),
            heartbeat_relay_url=relay.url,
            env={
                "HOST_MONITOR_AGENT_TOKEN": "",
                "HOST_MONITOR_NODE_CREDENTIAL": node_credential(NODE_KEY, node),
            },
            **flags,
        )
        for _ in range(count)
    ]


def _alive(supervisor: Supervisor, agents: list[Agent]) -> bool:
    return all((n := supervisor.node(a.node)) is not None and n["alive"] for a in agents)


def test_host_monitors_beat_through_a_relay_and_beat_directly_once_it_is_gone(
    rack: Rack, relay: Relay
) -> None:
    supervisor = rack.supervisor
    agents = _agents(rack, relay, 3)
    wait_for(lambda: _alive(supervisor, agents), 15, "the nodes alive at the supervisor")
    # Several periods: every heartbeat through the relay, in batches.
    wait_for(lambda: relay.counts()["heartbeats"] >= 3 * 5, 15, "heartbeats relayed")
    counts = relay.counts()
    assert counts["batches"] < counts["heartbeats"]

    relay.kill()
    # Three heartbeat timeouts (1 s each) with the relay gone: no node lost.
    time.sleep(scaled(3.0))
    assert _alive(supervisor, agents)
    for agent in agents:
        assert supervisor.events(agent.node, "host_heartbeat_lost") == []


def test_a_relay_speaks_for_no_node_whose_credential_it_does_not_hold(
    rack: Rack, relay: Relay
) -> None:
    supervisor = rack.supervisor
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


async def test_the_relay_answers_each_heartbeat_as_the_supervisor_would(relay: Relay) -> None:
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


async def test_a_heartbeat_marked_urgent_is_sent_at_once_with_the_ones_held(rack: Rack) -> None:
    """A relay holding a heartbeat for its interval (ten minutes here) sends it as soon as
    a heartbeat marked urgent comes, in one batch; then it holds again."""
    relay = HeartbeatRelay(
        rack.supervisor.url, node_credential(NODE_KEY, "relay-host"), interval_s=600
    )
    sender = asyncio.create_task(relay.run())
    nodes = [f"hm-{uuid.uuid4().hex[:8]}" for _ in range(3)]

    def beat(node: str, *extra: tuple[str, str]) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {node_credential(NODE_KEY, node)}", **dict(extra)}
        return {"content": b'{"node":"%s","state":"spare"}' % node.encode(), "headers": headers}

    transport = httpx.ASGITransport(app=relay)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://relay") as client:
            url = "/api/v1/heartbeats"
            held = asyncio.create_task(client.post(url, **beat(nodes[0])))
            await wait_until_async(lambda: relay.counts()["held"] == 1, "a heartbeat held", 10)
            urgent = await asyncio.wait_for(
                client.post(url, **beat(nodes[1], (URGENT_HEADER, "1"))), scaled(10)
            )
            assert urgent.status_code == 202, urgent.text
            assert (await asyncio.wait_for(held, scaled(10))).status_code == 202
            assert relay.counts() | {"held": 0} == {
                "status": "ok",
                "batches": 1,
                "heartbeats": 2,
                "urgent": 1,
                "held": 0,
            }
            # Held again for the interval: not sent a second later.
            later = asyncio.create_task(client.post(url, **beat(nodes[2])))
            await wait_until_async(lambda: relay.counts()["held"] == 1, "a heartbeat held", 10)
            await asyncio.sleep(1.0)
            assert not later.done() and relay.counts()["batches"] == 1
            later.cancel()
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender
    assert rack.supervisor.node(nodes[0]) is not None
    assert rack.supervisor.node(nodes[1]) is not None


def test_a_host_monitor_marks_urgent_the_heartbeat_of_a_worker_state_change(
    rack: Rack, relay: Relay
) -> None:
    """Periodic heartbeats through the relay are held for its interval; the one a worker's
    start sends at once is marked urgent, and the relay sends it without waiting."""
    [agent] = _agents(rack, relay, 1)
    wait_for(lambda: relay.counts()["heartbeats"] >= 10, 15, "periodic heartbeats relayed")
    before = relay.counts()
    assert before["urgent"] < before["heartbeats"] / 2  # periodic ones are not urgent
    rack.cluster.start_workers(agent, [0])
    rack.cluster.wait_running(agent, [0])
    wait_for(lambda: relay.counts()["urgent"] > before["urgent"], 15, "an urgent heartbeat")
    wait_for(lambda: _running(rack.supervisor, agent), 15, "rank 0 running at the supervisor")


def _running(supervisor: Supervisor, agent: Agent) -> bool:
    node = supervisor.node(agent.node)
    return node is not None and any(w["state"] == "running" for w in node["workers"])


def test_a_relay_serves_https_and_a_host_monitor_that_cannot_verify_it_beats_directly(
    rack: Rack, tmp_path: Path
) -> None:
    """With a certificate and key the relay serves HTTPS; a host monitor whose tls_ca_file
    issued the certificate beats through it, one with another CA refuses it (said once)
    and sends its heartbeats to the supervisor directly: no node is lost."""
    certificate = issued(tmp_path, "relay")
    other_ca = issued(tmp_path, "other").ca
    with Relay(tmp_path, rack.supervisor.url, certificate) as relay:
        with pytest.raises(httpx.ConnectError, match=VERIFY_FAILED):
            httpx.get(f"{relay.url}/healthz", verify=client_context(other_ca), timeout=5)
        with pytest.raises(httpx.TransportError):  # plain HTTP gets no HTTP answer
            http.get(f"http://127.0.0.1:{relay.port}/healthz", timeout=5)
        (verifies,) = _agents(rack, relay, 1, tls_ca_file=certificate.ca)
        (refuses,) = _agents(rack, relay, 1, tls_ca_file=other_ca)
        agents = [verifies, refuses]
        wait_for(lambda: _alive(rack.supervisor, agents), 15, "both nodes alive")
        wait_for(lambda: relay.counts()["heartbeats"] >= 5, 15, "heartbeats relayed over https")
        time.sleep(scaled(1.0))  # five heartbeat periods more, each refusing the relay
        assert _alive(rack.supervisor, agents)
        relay_failures = [
            line for line in refuses.log.read_text().splitlines() if "heartbeat relay" in line
        ]
        # Said once, however many heartbeats went around it.
        assert len(relay_failures) == 1, relay_failures
        assert VERIFY_FAILED in relay_failures[0] and "sending directly" in relay_failures[0]
        assert VERIFY_FAILED not in verifies.log.read_text()
        for agent in agents:
            assert rack.supervisor.events(agent.node, "host_heartbeat_lost") == []


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--tls-cert-file", "{cert}"],
            "--tls-cert-file is set without --tls-key-file: HTTPS needs both",
        ),
        (
            ["--tls-cert-file", "{cert}", "--tls-key-file", "{missing}"],
            "--tls-key-file {missing}: cannot read it (No such file or directory)",
        ),
        (
            ["--tls-cert-file", "{cert}", "--tls-key-file", "{other_key}"],
            "--tls-cert-file {cert} and --tls-key-file {other_key}: not a PEM certificate "
            "and its key",
        ),
    ],
    ids=["half", "unreadable key", "another key"],
)
def test_the_relay_refuses_tls_settings_it_cannot_serve_with_at_start(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    certificate = issued(tmp_path, "relay")
    names = {
        "cert": certificate.cert,
        "missing": tmp_path / "no-such.key",
        "other_key": issued(tmp_path, "other").key,
    }
    credential = tmp_path / "relay.credential"
    credential.write_text(node_credential(NODE_KEY, "relay-host"))
    done = subprocess.run(
        relay_command(
            "http://127.0.0.1:9",
            *("--credential-file", str(credential), "--port", str(free_port())),
            *(flag.format(**names) for flag in flags),
        ),
        capture_output=True,
        text=True,
        timeout=scaled(30),
    )
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"host-monitor relay: {message.format(**names)}"), line

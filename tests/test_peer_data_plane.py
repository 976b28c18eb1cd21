"""The peer tier's data channel, spoken to directly: real `host-monitor` processes, raw
sockets on loopback.

What a partner (or anyone reaching the port) can and cannot do: without the peer token
nothing is read past the header; an upload the store will refuse (older than the copy
kept, no room) is refused before its bytes move; bytes that arrive other than sent are
not committed; a partner without a channel gets its files over HTTP. Pushes and fetches
through the channel end to end are tests/test_host_monitor_peer.py's (and over TLS,
tests/test_tls.py's).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import crc32c
import httpx
import pytest

from host_monitor.peer.store import Mismatch, PeerStore
from host_monitor.peer.wire import recv_frame, send_frame
from resiliency_protocol.checkpoint_manifest import Manifest
from resiliency_protocol.peer_checkpoints import ChannelReply, ChannelRequest
from tests.test_host_monitor import WORKER_TOKEN, Cluster
from tests.test_host_monitor_peer import (
    JOB,
    PEER,
    PEER_TOKEN,
    Node,
    Peers,
    make_checkpoint,
    manifest,
    shard,
)
from tests.test_tls import Pki, monitor_verify, pki, start_tls_agent
from tests.timing import scaled

CAP = 4 * 1024 * 1024  # the capped node's store
__all__ = ["pki"]  # tests/test_tls.py's fixture, used here


class Nodes(Peers):
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.a = self.start("node-a")
        self.b = self.start("node-b")
        self.s = self.start("node-s")
        # No data channel (a partner of an older version), and one with a small store.
        self.http_only = self.start("node-http", peer_channel="false")
        self.capped = self.start("node-capped", peer_store_max_bytes=CAP)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    cluster = Cluster(tmp_path_factory.mktemp("channel"))
    try:
        yield Nodes(cluster)
    finally:
        cluster.teardown()


def channel_port(node: Node) -> int | None:
    r = node.peer_api.get("/v1/peer/channel")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tls"] is False
    return body["port"]  # type: ignore[no-any-return]


def connect(node: Node) -> socket.socket:
    port = channel_port(node)
    assert port is not None
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def request(**fields: Any) -> ChannelRequest:
    return ChannelRequest.model_validate(
        {"token": PEER_TOKEN, "job": JOB, "rank": 0, "step": 1, "name": "x.distcp", **fields}
    )


def reply(sock: socket.socket) -> ChannelReply:
    return ChannelReply.model_validate_json(recv_frame(sock))


def closed(sock: socket.socket) -> bool:
    """The server closed the connection (reset counts too)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def incoming(node: Node) -> list[Path]:
    return [p for p in (node.store / ".incoming").rglob("*") if p.is_file()]


def test_the_channel_is_announced_to_partners_only(nodes: Nodes) -> None:
    assert isinstance(channel_port(nodes.b), int)
    assert channel_port(nodes.http_only) is None
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(f"{nodes.b.url}/v1/peer/channel", headers=headers)
        assert r.status_code == 401, r.text


def test_no_byte_is_read_without_the_peer_token(nodes: Nodes) -> None:
    b = nodes.b
    body = b"A" * 65536
    for token in ("wrong", ""):
        with connect(b) as sock:
            header = request(token=token, op="put", size=len(body)).model_dump_json()
            data = header.encode()
            # The header and the file at once, as a client that does not wait would send.
            sock.sendall(b"RSPW" + struct.pack(">I", len(data)) + data + body)
            answer = reply(sock)
            assert answer.status == 401 and "peer token" in (answer.detail or ""), answer
            assert closed(sock)
    assert incoming(b) == []
    # Not a frame at all (an HTTP request, say): closed without an answer.
    with connect(b) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert closed(sock)
    # The token first: a bad request without it says nothing about the request.
    with connect(b) as sock:
        frame = json.dumps({"token": "wrong", "op": "delete"}).encode()
        sock.sendall(b"RSPW" + struct.pack(">I", len(frame)) + frame)
        assert reply(sock).status == 401
    with connect(b) as sock:
        frame = json.dumps({"token": PEER_TOKEN, "op": "delete"}).encode()
        sock.sendall(b"RSPW" + struct.pack(">I", len(frame)) + frame)
        answer = reply(sock)
        assert answer.status == 422 and (answer.detail or "").startswith("op:"), answer


def test_an_upload_the_store_refuses_is_refused_before_its_bytes(nodes: Nodes) -> None:
    b, capped = nodes.b, nodes.capped
    # A copy of rank 6 saved at `now`; an upload of an older save of it is refused.
    now = time.time()
    files = {"__0_0.distcp": shard(1000, 6)}
    b.upload(6, 20, files)
    assert b.commit(6, 20, manifest(20, 6, files, created=now)).status_code == 200
    with connect(b) as sock:
        send_frame(sock, request(op="put", rank=6, step=19, size=10, created=now - 60))
        answer = reply(sock)
        assert answer.status == 409 and "step 20" in (answer.detail or ""), answer
    # No room: 507 naming the cap; nothing written.
    with connect(capped) as sock:
        send_frame(sock, request(op="put", size=CAP + 1))
        answer = reply(sock)
        assert answer.status == 507 and str(CAP) in (answer.detail or ""), answer
    assert incoming(capped) == []
    # And over HTTP alike.
    r = capped.peer_api.put(
        f"/v1/peer/checkpoints/{JOB}/0/1/files/x.distcp", content=b"x" * (CAP + 1)
    )
    assert r.status_code == 507, r.text


def test_bytes_that_arrive_other_than_sent_are_not_committed(nodes: Nodes) -> None:
    b = nodes.b
    good = shard(3 * 1024 * 1024 + 5, 7)
    body = manifest(30, 7, {"x.distcp": good})
    for data in (b"X" + good[1:], good):
        with connect(b) as sock:
            send_frame(sock, request(op="put", rank=7, step=30, size=len(data)))
            assert reply(sock).status == 100
            sock.sendall(data)
            answer = reply(sock)
        # The size and checksum received: what the sender compares with its manifest.
        assert (answer.status, answer.size) == (200, len(data)), answer
        assert (answer.checksum == crc32c.crc32c(good)) == (data == good)
        r = b.commit(7, 30, body)
        if data != good:
            assert r.status_code == 409, r.text
            assert r.json()["detail"].startswith("files.x.distcp: crc32c"), r.text
    assert r.status_code == 200 and r.json()["committed"] is True, r.text
    # Out again over the channel: the same bytes.
    with connect(b) as sock:
        send_frame(sock, request(op="get", rank=7, step=30))
        answer = reply(sock)
        assert (answer.status, answer.size) == (200, len(good)), answer
        received = bytearray()
        while len(received) < len(good):
            chunk = sock.recv(1 << 20)
            assert chunk, "the file was cut short"
            received += chunk
        assert bytes(received) == good
    with connect(b) as sock:
        send_frame(sock, request(op="get", rank=7, step=29))
        assert reply(sock).status == 404


def test_a_sender_short_of_its_size_leaves_nothing(nodes: Nodes) -> None:
    b = nodes.b
    with connect(b) as sock:
        send_frame(sock, request(op="put", rank=8, step=3, size=1000))
        assert reply(sock).status == 100
        sock.sendall(b"y" * 10)
    # The store drops the part file once the connection ends.
    deadline = time.monotonic() + scaled(10)
    while incoming(b) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert incoming(b) == []


def test_a_partner_without_a_channel_gets_its_files_over_http(nodes: Nodes) -> None:
    a, http_only, s = nodes.a, nodes.http_only, nodes.s
    a.set_partner(http_only)
    s.set_partner(http_only)
    files = {".metadata": shard(100, 1), "__0_0.distcp": shard(2 * 1024 * 1024 + 3, 9)}
    saved = make_checkpoint(a.root / "tier", 60, 2, files)
    a.replicate(2, 60, saved)
    assert a.wait_pushed(2, 60)["state"] == "done"
    r = s.agent.worker_api.post(
        "/v1/workers/2/checkpoints/fetch-peer", json={"step": 60, "dest": str(s.root / "tier")}
    )
    assert r.status_code == 200 and r.json()["bytes"] == sum(map(len, files.values())), r.text
    restored = Path(r.json()["path"])
    assert {n: (restored / n).read_bytes() for n in files} == files


async def test_a_file_changed_after_it_arrived_is_read_again_at_commit(tmp_path: Path) -> None:
    """The checksum computed on arrival stands for the file only while it is unchanged."""
    store = PeerStore(tmp_path / "store", max_file_bytes=1 << 30)
    store.start()
    data = shard(100_000, 3)
    body = Manifest.model_validate(manifest(5, 0, {"f.distcp": data}))

    async def chunks() -> AsyncIterator[bytes]:
        yield data

    await store.receive(JOB, 0, 5, "f.distcp", chunks())
    path = tmp_path / "store" / ".incoming" / JOB / "rank-0" / "step-0000000005" / "f.distcp"
    await asyncio.sleep(0.01)  # another mtime
    path.write_bytes(b"Z" + data[1:])  # same size, another content
    with pytest.raises(Mismatch, match="crc32c"):
        await store.commit(JOB, 0, 5, body)
    # Uploaded again, unchanged since: committed from the sum kept on arrival.
    await store.receive(JOB, 0, 5, "f.distcp", chunks())
    result = await store.commit(JOB, 0, 5, body)
    assert result.committed
    copy = store.newest(JOB, 0)
    assert copy is not None and copy.step == 5
    await store.close()


def test_the_channel_of_an_https_monitor_speaks_tls_only(pki: Pki, tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    try:
        root = tmp_path / "ram"
        root.mkdir()
        agent = start_tls_agent(
            cluster,
            pki,
            env={"HOST_MONITOR_PEER_TOKEN": PEER_TOKEN},
            initial_state="running",
            job=JOB,
            checkpoint_root=root,
            peer_store_dir=tmp_path / "peer",
        )
        verify = monitor_verify(pki)
        info = httpx.get(f"{agent.url}/v1/peer/channel", headers=PEER, verify=verify).json()
        assert info["tls"] is True and isinstance(info["port"], int), info
        address = ("127.0.0.1", info["port"])
        # In plain text: no answer at all (the handshake fails), nothing read.
        with socket.create_connection(address, timeout=10) as sock:
            send_frame(sock, request(op="get"))
            assert closed(sock)
        # Over TLS, checked against the certificate's name as partners check it.
        with (
            socket.create_connection(address, timeout=10) as raw,
            verify.wrap_socket(raw, server_hostname="127.0.0.1") as sock,
        ):
            send_frame(sock, request(op="get", token="wrong"))
            assert reply(sock).status == 401
        with (
            socket.create_connection(address, timeout=10) as raw,
            verify.wrap_socket(raw, server_hostname="127.0.0.1") as sock,
        ):
            send_frame(sock, request(op="get"))
            assert reply(sock).status == 404  # no such copy: but the token was good
    finally:
        cluster.teardown()


def test_a_worker_has_its_partner_copy_relayed_with_its_own_token(nodes: Nodes) -> None:
    b, s = nodes.b, nodes.s
    s.set_partner(b)
    data = shard(2 * 1024 * 1024 + 11, 4)
    b.upload(9, 70, {"x.distcp": data})
    assert b.commit(9, 70, manifest(70, 9, {"x.distcp": data}, world_size=16)).status_code == 200
    r = s.agent.worker_api.get("/v1/workers/9/checkpoints/channel")
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["port"] == channel_port(s) and info["tls"] is False
    assert Path(info["local"]).is_socket()
    relay = request(op="relay", token=WORKER_TOKEN, rank=9, step=70)
    # The worker token relays, and opens nothing else; the peer token does not relay.
    for wrong in (request(op="relay", rank=9, step=70), request(op="get", token=WORKER_TOKEN)):
        with connect(s) as sock:
            send_frame(sock, wrong)
            assert reply(sock).status == 401
    with connect(s) as sock:  # over TCP: the bytes pass through the host monitor
        send_frame(sock, relay)
        answer = reply(sock)
        assert (answer.status, answer.size) == (200, len(data)), answer
        assert receive_all(sock, len(data)) == data
    # Over the Unix socket: the partner's connection itself is handed over.
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(info["local"])
        send_frame(sock, relay)
        head, fds, _, _ = socket.recv_fds(sock, 4096, 1)
        assert len(fds) == 1
        with socket.socket(fileno=fds[0]) as handed:
            assert handed.family == socket.AF_INET  # a TCP connection, to the partner
            handed.settimeout(10)
            length = struct.unpack(">I", head[4:8])[0]
            answer = ChannelReply.model_validate_json(head[8 : 8 + length])
            assert (answer.status, answer.size) == (200, len(data)), answer
            assert receive_all(handed, len(data)) == data
    # The Unix socket only relays; a step the partner does not keep is 404.
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(info["local"])
        send_frame(sock, request(op="get", rank=9, step=70))
        assert reply(sock).status == 403
    with connect(s) as sock:
        send_frame(sock, request(op="relay", token=WORKER_TOKEN, rank=9, step=71))
        assert reply(sock).status == 404


def receive_all(sock: socket.socket, size: int) -> bytes:
    received = bytearray()
    while len(received) < size:
        chunk = sock.recv(1 << 20)
        assert chunk, f"cut short at {len(received)} of {size} bytes"
        received += chunk
    return bytes(received)

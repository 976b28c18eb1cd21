"""A host monitor's peer probes (host_monitor/peer/probes.py) against real sockets: a peer
is named unreachable only after PROBE_MISSES rounds without an answer, and no longer once
it answers; the targets come from the supervisor's answer, fetched with the node's
credential."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from host_monitor.credentials import BearerCredential
from host_monitor.peer.probes import PROBE_MISSES, PeerProbes
from supervisor.local.ports import free_port


class Handler(BaseHTTPRequestHandler):
    """/healthz answers; the supervisor's probe targets name two peers, for node n1's token."""

    targets: dict[str, Any] = {}

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._reply(200, {"status": "ok"})
        elif self.path == "/api/v1/nodes/n1/probe-targets":
            if self.headers.get("Authorization") != "Bearer n1-token":
                self._reply(401, {"detail": "no"})
            else:
                self._reply(200, self.targets)
        else:
            self._reply(404, {"detail": "not found"})

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


async def test_a_peer_is_unreachable_after_missed_rounds_and_reachable_once_it_answers(
    server: ThreadingHTTPServer,
) -> None:
    live = f"http://127.0.0.1:{server.server_address[1]}"
    dead_port = free_port()  # nothing listens: refused, as a peer whose host monitor is gone
    Handler.targets = {
        "peers": [
            {"node": "n2", "url": live},
            {"node": "n3", "url": f"http://127.0.0.1:{dead_port}"},
        ]
    }
    probes = PeerProbes(live, BearerCredential(token="n1-token"), "n1", period_s=0.05)
    runner = asyncio.create_task(probes.run())
    try:
        for _ in range(200):  # targets fetched, then PROBE_MISSES rounds (1 s apart)
            if probes.unreachable():
                break
            await asyncio.sleep(0.05)
        assert probes.unreachable() == ["n3"]
    finally:
        runner.cancel()
    # Round by round: n3 listens again; one answer clears it.
    async with httpx.AsyncClient(timeout=1.0) as client:
        revived = ThreadingHTTPServer(("127.0.0.1", dead_port), Handler)
        threading.Thread(target=revived.serve_forever, daemon=True).start()
        try:
            await probes.probe(client)
            assert probes.unreachable() == []
        finally:
            revived.shutdown()
            revived.server_close()
        # Gone again: named only after PROBE_MISSES rounds.
        for missed in range(1, PROBE_MISSES + 1):
            await probes.probe(client)
            assert probes.unreachable() == ([] if missed < PROBE_MISSES else ["n3"])


async def test_another_nodes_credential_gets_no_targets(server: ThreadingHTTPServer) -> None:
    url = f"http://127.0.0.1:{server.server_address[1]}"
    Handler.targets = {"peers": [{"node": "n2", "url": url}]}
    probes = PeerProbes(url, BearerCredential(token="someone-else"), "n1", period_s=0.05)
    async with httpx.AsyncClient(timeout=1.0) as client:
        await probes._refresh(client)
        await probes.probe(client)
    assert probes.unreachable() == [] and probes._targets == []

"""Our servers keep an idle HTTP connection open longer than our clients reuse one
(resiliency_protocol.shared_settings: SERVER_KEEP_ALIVE_S, CLIENT_KEEP_ALIVE_S).

With uvicorn's default (5 s) a heartbeat every 5 s met the server's close of its
connection head on, and the request failed with "Server disconnected without sending a
response": a test's poll of the supervisor failed so on CI. Checked on the real processes,
with h11 over a plain socket: a client library that drops idle connections itself would
hide a server that closes them.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import h11
import httpx

from resiliency_protocol.shared_settings import CLIENT_KEEP_ALIVE_S, SERVER_KEEP_ALIVE_S
from tests.test_e2e import serving
from tests.test_host_monitor import Cluster

#: Longer than uvicorn's and httpx's default keep-alive (5 s): the old servers had closed
#: the connection by then.
IDLE_S = 6.0


def statuses_on_one_connection(url: str, path: str, idle_s: float) -> list[int]:
    """The status of two GETs of `path` sent on one HTTP/1.1 connection, `idle_s` apart."""
    target = httpx.URL(url)
    assert target.port is not None
    statuses = []
    with socket.create_connection((target.host, target.port), timeout=5) as sock:
        connection = h11.Connection(h11.CLIENT)
        for attempt in range(2):
            if attempt:
                time.sleep(idle_s)
                connection.start_next_cycle()
            request = h11.Request(method="GET", target=path, headers=[("Host", target.host)])
            sock.sendall(connection.send(request) + connection.send(h11.EndOfMessage()))
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    connection.receive_data(sock.recv(65536))  # b"": the server closed it
                elif isinstance(event, h11.Response):
                    statuses.append(event.status_code)
                elif isinstance(event, h11.EndOfMessage):
                    break
    return statuses


def test_the_clients_give_up_an_idle_connection_before_the_servers_do() -> None:
    assert CLIENT_KEEP_ALIVE_S + 10 <= SERVER_KEEP_ALIVE_S


def test_the_supervisor_keeps_an_idle_connection_open(tmp_path: Path) -> None:
    with serving(tmp_path) as server:
        assert statuses_on_one_connection(server.url, "/healthz", IDLE_S) == [200, 200]


def test_a_host_monitor_keeps_an_idle_connection_open(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    try:
        url = cluster.start_agent(None).url
        assert statuses_on_one_connection(url, "/healthz", IDLE_S) == [200, 200]
    finally:
        cluster.teardown()

"""The local cluster's ports: a port handed out is not handed out again while its server
may still be starting, and a held port is skipped by every chooser and taken by its own
server."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.local import ports
from supervisor.local.ports import RESERVED_S, free_port, hold_port


@pytest.fixture(autouse=True)
def own_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The record of handed-out ports in this test's folder, not the machine's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def _unused_ports(n: int) -> list[int]:
    """`n` ports free now in the range free_port chooses from, none handed out."""
    found: list[int] = []
    port = ports.LOWEST_PORT + 500
    while len(found) < n:
        port += 7
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
    return found


def _picks(monkeypatch: pytest.MonkeyPatch, order: list[int]) -> None:
    chosen: Iterator[int] = iter(order)
    monkeypatch.setattr(ports.random, "randrange", lambda low, high: next(chosen))


def test_a_port_handed_out_is_not_handed_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = _unused_ports(2)
    _picks(monkeypatch, [first, first, second])
    assert free_port() == first
    # Still unbound (its server is starting): free by bind, but handed out already.
    assert free_port() == second
    assert (ports._handed_out() / str(first)).exists()  # what another process reads


def test_a_port_is_handed_out_again_once_its_reservation_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (port,) = _unused_ports(1)
    _picks(monkeypatch, [port, port])
    assert free_port() == port
    long_ago = time.time() - RESERVED_S - 1
    os.utime(ports._handed_out() / str(port), (long_ago, long_ago))
    assert free_port() == port


def test_a_held_port_is_skipped_and_its_own_server_binds_beside_the_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    held, other = _unused_ports(2)
    with hold_port("127.0.0.1", held):
        _picks(monkeypatch, [held, other])
        assert free_port() == other  # never recorded, but held: a plain bind fails
        with socket.socket() as server:  # as uvicorn's (asyncio's) server binds
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", held))
            server.listen()


def test_holding_a_port_in_use_says_which() -> None:
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with pytest.raises(OSError, match=f"port {port} on 127.0.0.1 is in use"):
            hold_port("127.0.0.1", port)


def _unused_block(span: int, after: int) -> int:
    """The first of `span` consecutive ports above `after`, each free now."""
    first = after
    while True:
        first += span + 1
        if all(ports._bindable(port) for port in range(first, first + span)):
            return first


def test_a_span_is_handed_out_whole_and_never_over_a_port_in_use_or_handed_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    taken = _unused_block(4, ports.LOWEST_PORT + 600)
    given = _unused_block(4, taken + 4)
    chosen = _unused_block(4, given + 4)
    _picks(monkeypatch, [given + 2])  # a port of `given`, handed out alone
    assert free_port() == given + 2
    with socket.socket() as server:  # another program's server on `taken`'s third port
        server.bind(("127.0.0.1", taken + 2))
        server.listen()
        _picks(monkeypatch, [taken, given, chosen])
        assert free_port(span=4) == chosen
    handed = ports._handed_out()
    assert all((handed / str(port)).exists() for port in range(chosen, chosen + 4))
    assert not (handed / str(taken)).exists() and not (handed / str(given)).exists()
    # Each port of the span is kept from the next chooser too.
    after = _unused_block(1, chosen + 4)
    _picks(monkeypatch, [chosen + 3, after])
    assert free_port() == after


def test_a_span_below_one_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="span must be at least 1, got 0"):
        free_port(span=0)

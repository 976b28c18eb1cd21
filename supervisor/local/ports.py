"""Loopback ports for the local cluster's servers: chosen free, kept from the other
processes of ours that choose ports on this machine, and held while a server restarts."""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

#: Ports chosen here lie in [LOWEST_PORT, the ephemeral range's start - PORT_HEADROOM):
#: the kernel hands none of them to a connection's local end or to a bind to port 0, so
#: a port chosen now is still free when its server binds it seconds later (a torch rank's
#: rendezvous store after its imports); above, any outgoing connection may take it. The
#: headroom keeps the ports of the worlds that follow a first MASTER_PORT below it too.
LOWEST_PORT = 20000
PORT_HEADROOM = 128
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: A port handed out is not handed out again, by any process of this user on this
#: machine, for this long: a free port is free only until its server binds it, and two
#: servers chosen the same port while the first was still starting (imports, a restart)
#: left one of them answering for the other.
RESERVED_S = 600.0


def _ephemeral_start() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _handed_out() -> Path:
    return Path(tempfile.gettempdir()) / f"resiliency-supervisor-ports-{os.getuid()}"


@contextlib.contextmanager
def _choosing() -> Iterator[Path]:
    """The folder of ports handed out recently (one empty file each, named by the port,
    its time its mtime), locked against the other processes choosing now."""
    folder = _handed_out()
    folder.mkdir(mode=0o700, exist_ok=True)
    with (folder / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield folder


def _recent(folder: Path, port: int, now: float) -> bool:
    try:
        return now - (folder / str(port)).stat().st_mtime < RESERVED_S
    except FileNotFoundError:
        return False


def free_port(span: int = 1) -> int:
    """A TCP port free on 127.0.0.1 right now, below the ephemeral range (see
    LOWEST_PORT) and not handed out here in the last RESERVED_S; one the kernel picks
    where that range leaves no room below it (its neighbours then unchecked).

    `span`: the first of that many consecutive such ports, all handed out: a job given
    one MASTER_PORT takes the ports above it for its later worlds (an in-process heal's
    rendezvous), and one of those handed to another server made the heal's new world
    fail to form (EADDRINUSE)."""
    if span < 1:
        raise ValueError(f"span must be at least 1, got {span}")
    top = _ephemeral_start() - PORT_HEADROOM
    if top - LOWEST_PORT >= 1024 + span:
        with _choosing() as folder:
            now = time.time()
            for _ in range(256):
                first = random.randrange(LOWEST_PORT, top - span + 1)
                chosen = range(first, first + span)
                if any(_recent(folder, port, now) for port in chosen):
                    continue
                if not all(_bindable(port) for port in chosen):
                    continue
                for port in chosen:
                    (folder / str(port)).touch()
                return first
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        picked: int = s.getsockname()[1]
        return picked


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def hold_port(address: str, port: int) -> socket.socket:
    """A socket bound to `address:port`, not listening, that keeps the port ours until it
    is closed: `free_port` (a plain bind) skips it in every process, while a server of
    ours binds it beside the hold (SO_REUSEADDR on both, as asyncio's servers set). An
    OSError naming the port when it is in use already."""
    hold = socket.socket()
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        hold.bind((address, port))
    except OSError as exc:
        hold.close()
        raise OSError(exc.errno, f"port {port} on {address} is in use ({exc.strerror})") from exc
    return hold

"""The partition harness itself (tests/netns.py): hosts in network namespaces of their
own reach each other over the switch, and each fault cuts exactly what it says, one way
or both, until healed; nothing is left behind."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.netns import Network, unavailable

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

PORT = 8765
# Listens on the host's port; answers each connection with the host's name.
SERVER = """
import socket, sys
s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
while True:
    c, _ = s.accept()
    c.sendall(sys.argv[2].encode()); c.close()
"""
# Connects from the host it runs on; prints what it got, or "-" when it could not.
CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.0) as c:
        print(c.recv(100).decode())
except OSError:
    print("-")
"""


@pytest.fixture
def net() -> Iterator[Network]:
    network = Network()
    try:
        procs = []
        for name in ("a", "b", "c"):
            host = network.add_host(name)
            procs.append(
                subprocess.Popen([*host.exec_args(), sys.executable, "-c", SERVER, str(PORT), name])
            )
        for name in ("a", "b", "c"):  # listening
            deadline = time.monotonic() + 20
            while reach(network, None, name) != name and time.monotonic() < deadline:
                time.sleep(0.1)
        yield network
    finally:
        network.close()
    for proc in procs:
        assert proc.wait(10) is not None  # killed with its namespace


def reach(net: Network, source: str | None, target: str) -> str:
    """What `target` answers to `source` (None: the console), "-" when nothing."""
    prefix = [] if source is None else net.hosts[source].exec_args()
    address = net.hosts[target].address
    out = subprocess.run(
        [*prefix, sys.executable, "-c", CLIENT, address, str(PORT)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return out.stdout.strip()


def test_hosts_reach_each_other_and_nothing_else() -> None:
    with Network() as net:
        host = net.add_host("a")
        routes = subprocess.run(
            [*host.exec_args(), "ip", "route"], capture_output=True, text=True, check=True
        ).stdout
        assert "default" not in routes  # nothing leaves the machine
        out = subprocess.run(
            [*host.exec_args(), sys.executable, "-c", CLIENT, "192.0.2.1", "80"],
            capture_output=True,
            text=True,
        )
        assert out.stdout.strip() == "-"
        namespaces = subprocess.run(["ip", "netns"], capture_output=True, text=True).stdout
        assert host.namespace in namespaces
    namespaces = subprocess.run(["ip", "netns"], capture_output=True, text=True).stdout
    assert net.tag not in namespaces  # torn down


def test_link_down_cuts_the_host_from_everyone_until_healed(net: Network) -> None:
    assert reach(net, "a", "b") == "b"
    net.link_down("b")
    assert reach(net, "a", "b") == "-"
    assert reach(net, "b", "c") == "-"
    assert reach(net, None, "b") == "-"
    assert reach(net, "a", "c") == "c"  # the others still talk
    net.heal("b")
    assert reach(net, "a", "b") == "b"


def test_drop_one_way_and_both_ways(net: Network) -> None:
    # b drops what it gets from a: a cannot connect to b, b still gets c's connections.
    net.drop("b", "a", "in")
    assert reach(net, "a", "b") == "-"
    assert reach(net, "c", "b") == "b"
    net.heal("b")
    assert reach(net, "a", "b") == "b"
    # b drops what it sends to a only: a's SYN arrives but no answer leaves; the rule
    # is on b's way out (the console still sees b).
    net.drop("b", "a", "out")
    assert reach(net, "a", "b") == "-"
    assert reach(net, None, "b") == "b"
    net.heal("b")
    # Both ways, from every other host; the console keeps its view.
    net.drop("b", None, "both")
    assert reach(net, "a", "b") == "-"
    assert reach(net, "b", "c") == "-"
    assert reach(net, None, "b") == "b"
    net.heal("b")
    assert reach(net, "b", "c") == "c"

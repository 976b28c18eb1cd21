"""Hosts with a network of their own, on one machine: Linux network namespaces.

`Network` makes one namespace per host and a switch namespace holding a bridge; each host
is joined to the bridge by a veth pair and has one address on a /24 of its own and no
default route, so that a packet to a host that is cut off goes nowhere rather than out of
the machine. The test process itself reaches the hosts through one more veth pair (the
console port): it watches and drives them as an operator would.

Faults, as the network would have them:
- `link_down(host)`: the host's cable is pulled (its port on the switch goes down);
- `drop(host, peer, direction)`: nftables rules in the host's namespace drop what it
  sends to `peer` ("out"), what it gets from `peer` ("in"), or both; `peer` None: every
  other host (the console port stays open, so the test can still look).
`heal(host)` undoes both. The kernel here has no `netem`, so there is no delay or loss rate.

Everything is removed by `close()` (processes in the namespaces are killed first); the
names carry the test process's pid, so runs side by side never meet.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

Direction = Literal["in", "out", "both"]
_TABLE = "partition"


def unavailable() -> str | None:
    """Why namespaces cannot be made here (the reason to skip), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (make test installs nftables)"
    probe = f"probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    try:
        nft = subprocess.run(
            ["ip", "netns", "exec", probe, "nft", "list", "tables"], capture_output=True, text=True
        )
        if nft.returncode != 0:
            return f"nftables does not work in a namespace: {nft.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*args: str) -> str:
    result = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result.stdout


@dataclass(frozen=True)
class Host:
    name: str
    namespace: str
    address: str
    port: str  # its port on the switch (an interface of the switch namespace)

    def exec_args(self) -> list[str]:
        """The prefix that runs a command on this host."""
        return ["ip", "netns", "exec", self.namespace]


class Network:
    """Hosts joined by one switch. Use as a context manager, or call `close()`."""

    def __init__(self, subnet: int | None = None) -> None:
        tag = os.getpid()
        # A /24 the machine does not route: chosen from the pid, moved on if taken.
        third = subnet if subnet is not None else 16 + tag % 200
        while _routed(f"10.243.{third}."):
            third = 16 + (third - 15) % 200
        self.prefix = f"10.243.{third}."
        self.tag = f"pt{tag}"
        self.switch = f"{self.tag}-switch"
        self.hosts: dict[str, Host] = {}
        self._console = f"{self.tag}c"[:15]
        self.console_address = self.prefix + "254"
        _run("ip", "netns", "add", self.switch)
        try:
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            _run("ip", "link", "add", self._console, "type", "veth", "peer", "name", "console",
                 "netns", self.switch)  # fmt: skip
            _run("ip", "-n", self.switch, "link", "set", "console", "master", "br0", "up")
            _run("ip", "addr", "add", f"{self.console_address}/24", "dev", self._console)
            _run("ip", "link", "set", self._console, "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_host(self, name: str) -> Host:
        index = len(self.hosts) + 1
        host = Host(name, f"{self.tag}-{name}", f"{self.prefix}{index}", f"h{index}")
        _run("ip", "netns", "add", host.namespace)
        self.hosts[name] = host
        _run("ip", "-n", self.switch, "link", "add", host.port, "type", "veth", "peer", "name",
             "eth0", "netns", host.namespace)  # fmt: skip
        _run("ip", "-n", self.switch, "link", "set", host.port, "master", "br0", "up")
        _run("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _run("ip", "-n", host.namespace, "link", "set", "eth0", "up")
        _run("ip", "-n", host.namespace, "link", "set", "lo", "up")
        return host

    # --- faults -------------------------------------------------------------------------

    def link_down(self, name: str) -> None:
        _run("ip", "-n", self.switch, "link", "set", self.hosts[name].port, "down")

    def link_up(self, name: str) -> None:
        _run("ip", "-n", self.switch, "link", "set", self.hosts[name].port, "up")

    def drop(self, name: str, peer: str | None = None, direction: Direction = "both") -> None:
        """Drop traffic between `name` and `peer` (None: every other host) in `direction`,
        seen from `name`. Rules add up until `heal`."""
        host = self.hosts[name]
        if peer is None:
            # Every host but the console: the switch's subnet, less the console's address.
            match = ["ip", "{}", f"{self.prefix}0/24"]
            exempt = ["ip", "{}", self.console_address, "accept"]
        else:
            match = ["ip", "{}", self.hosts[peer].address]
            exempt = []
        script = [
            f"add table inet {_TABLE}",
            f"add chain inet {_TABLE} input {{ type filter hook input priority 0 ; }}",
            f"add chain inet {_TABLE} output {{ type filter hook output priority 0 ; }}",
        ]
        for chain, field in (("input", "saddr"), ("output", "daddr")):
            if direction == ("out" if chain == "input" else "in"):
                continue
            words = [w.replace("{}", field) for w in match]
            if exempt:
                script.append(
                    f"insert rule inet {_TABLE} {chain} "
                    + " ".join(w.replace("{}", field) for w in exempt)
                )
            script.append(f"add rule inet {_TABLE} {chain} {' '.join(words)} drop")
        subprocess.run(
            [*host.exec_args(), "nft", "-f", "-"],
            input="\n".join(script) + "\n",
            text=True,
            check=True,
            capture_output=True,
        )

    def heal(self, name: str) -> None:
        """The host's cable back in and its drop rules gone."""
        self.link_up(name)
        host = self.hosts[name]
        subprocess.run(
            [*host.exec_args(), "nft", "delete", "table", "inet", _TABLE], capture_output=True
        )

    # --- reads --------------------------------------------------------------------------

    def pids(self, name: str) -> list[int]:
        """Processes running on the host (in its namespace)."""
        out = _run("ip", "netns", "pids", self.hosts[name].namespace)
        return [int(p) for p in out.split()]

    def close(self) -> None:
        """Kill what runs on the hosts, then remove every namespace and the console port."""
        for host in self.hosts.values():
            with contextlib.suppress(RuntimeError, subprocess.SubprocessError):
                for _ in range(50):
                    pids = self.pids(host.name)
                    if not pids:
                        break
                    for pid in pids:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    time.sleep(0.05)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", self._console], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)
        self.hosts.clear()


def _routed(prefix: str) -> bool:
    return prefix in _run("ip", "-4", "addr")


@contextlib.contextmanager
def network() -> Iterator[Network]:
    net = Network()
    try:
        yield net
    finally:
        net.close()

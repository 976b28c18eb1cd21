"""The `host-monitor` command, or one line saying to install the `host-monitor` extra."""

from __future__ import annotations

from resiliency_protocol.commands import run_cli


def main() -> None:
    run_cli("host_monitor.cli:main", "host-monitor", "host-monitor", "the node agent")

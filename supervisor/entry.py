"""The `supervisor` command: the CLI, or one line saying to install the `server` extra."""

from __future__ import annotations

from resiliency_protocol.commands import run_cli


def main() -> None:
    run_cli("supervisor.cli:main", "supervisor", "server", "the service and its CLI")

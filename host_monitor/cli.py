"""`host-monitor`: run the host monitor agent of one node.

Every setting is a flag (`--heartbeat-polling-period-s 5`) and an environment variable
(`HOST_MONITOR_HEARTBEAT_POLLING_PERIOD_S=5`); flags win. Prefer the environment for the
tokens: flags show in `ps`. An invalid setting stops start-up with one line and exit
code 2.

With `--launch [--nproc-per-node N] [--nnodes N --node-rank R --master-addr HOST] --
COMMAND...` it starts this node's workers itself, as torchrun does, and the supervisor
(local backend) heals them through it (host_monitor/launch.py); a COMMAND that cannot be
found stops start-up the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from host_monitor.config import ConfigError, HostMonitorSettings, load_settings
from host_monitor.launch import (
    LaunchError,
    add_arguments,
    launch_defaults,
    launch_of,
    spare_launch,
)
from resiliency_protocol.logs import configure_logging
from resiliency_protocol.shared_settings import host_monitor_env
from resiliency_protocol.tls import TLSError

PROG = "host-monitor"
# Short aliases for the flags people type most.
ALIASES = {"host_daemon_port": ["--port"]}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for name, field in HostMonitorSettings.model_fields.items():
        flags = [f"--{name.replace('_', '-')}", *ALIASES.get(name, [])]
        env = host_monitor_env(name)
        # Values stay strings here: the settings model validates them, so a bad flag
        # and a bad environment variable get the same one-line message.
        parser.add_argument(*flags, dest=name, metavar="VALUE", help=f"{field.description} [{env}]")
    return parser


def _configure_logging(settings: HostMonitorSettings) -> None:
    # One line per heartbeat at info would drown everything else.
    quiet = {} if settings.log_level == "debug" else {"httpx": logging.WARNING}
    configure_logging(
        settings.log_level,
        settings.log_format,
        fixed={"role": "host-monitor", "node": settings.node},
        quiet=quiet,
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["relay"]:  # the rack's heartbeat relay, not a node's agent
        from host_monitor.relay import main as relay

        relay(argv[1:])
        return
    parser = _parser()
    add_arguments(parser)  # --launch and its flags: not settings
    args = vars(parser.parse_args(argv))
    try:
        launch = launch_of(args)  # a command that cannot run stops us before anything
        if launch is not None:
            if launch.spare:
                # os.environ, so that the settings read no job either
                launch = spare_launch(launch, args, os.environ)
            args.update(launch_defaults(args, os.environ, spare=launch.spare))
        settings = load_settings(**args)
        settings.check_tls_files()
        if launch is not None and launch.spare and settings.supervisor_url is None:
            raise LaunchError(
                f"--node-rank {launch.node_rank} is a spare's (--nnodes {launch.nnodes}): "
                "a spare needs supervisor_url, the supervisor swaps it in"
            )
    except (ConfigError, TLSError, LaunchError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    _configure_logging(settings)

    from host_monitor.agent import Agent  # after the settings: a bad flag fails fast

    try:
        code = asyncio.run(Agent(settings, launch).run())
    except OSError as exc:  # e.g. the port is taken
        print(f"{PROG}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    raise SystemExit(code)


if __name__ == "__main__":
    main()

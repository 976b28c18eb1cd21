"""`host-monitor`: run the host monitor agent of one node.

Every setting is a flag (`--heartbeat-polling-period-s 5`) and an environment variable
(`HOST_MONITOR_HEARTBEAT_POLLING_PERIOD_S=5`); flags win. Prefer the environment for the
tokens: flags show in `ps`. An invalid setting stops start-up with one line and exit
code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from host_monitor.config import ConfigError, HostMonitorSettings, load_settings
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
        env = f"HOST_MONITOR_{name.upper()}"
        # Values stay strings here: the settings model validates them, so a bad flag
        # and a bad environment variable get the same one-line message.
        parser.add_argument(*flags, dest=name, metavar="VALUE", help=f"{field.description} [{env}]")
    return parser


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if level != "debug":
        # One line per heartbeat at info would drown everything else.
        logging.getLogger("httpx").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        settings = load_settings(**vars(args))
        settings.check_tls_files()
    except (ConfigError, TLSError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    _configure_logging(settings.log_level)

    from host_monitor.agent import Agent  # after the settings: a bad flag fails fast

    try:
        code = asyncio.run(Agent(settings).run())
    except OSError as exc:  # e.g. the port is taken
        print(f"{PROG}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    raise SystemExit(code)


if __name__ == "__main__":
    main()

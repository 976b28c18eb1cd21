"""Arguments shared by the operator commands: where the server is, how output is
printed, and the value types (durations such as 1h30m, times, KEY=VALUE)."""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from supervisor.ops import output
from supervisor.ops.client import Client
from supervisor.ops.config import (
    CA_ENV,
    CONFIG_ENV,
    SERVER_ENV,
    TOKEN_ENV,
    config_path,
    resolve,
)


def connection_options(
    *, url_alias: bool = False, timeout_s: float = 10.0, kubectl: bool = False
) -> argparse.ArgumentParser:
    """A parent parser: where the server is, and how output is printed. `kubectl`: the
    output options of the commands that list and show objects (-o wide, name,
    jsonpath=TEMPLATE; --no-headers)."""
    parent = argparse.ArgumentParser(add_help=False)
    where = parent.add_argument_group("server")
    where.add_argument(
        "--server",
        *(["--url"] if url_alias else []),
        dest="server",
        help=f"Supervisor URL, e.g. http://127.0.0.1:8080 (env {SERVER_ENV}; else the context's).",
    )
    where.add_argument("--token", help=f"Operator token (env {TOKEN_ENV}; else the context's).")
    where.add_argument("--context", help="Context of the config file to use (default: current).")
    where.add_argument(
        "--certificate-authority",
        metavar="FILE",
        help=f"CA bundle (PEM) that verifies an https:// server (env {CA_ENV}; else the "
        "context's; else the system's trust store).",
    )
    where.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="Name the server's certificate is checked against instead of the URL's host "
        "(e.g. the Service's, through a port-forward; else the context's).",
    )
    where.add_argument(
        "--config",
        dest="cli_config",
        metavar="FILE",
        help=f"Config file with contexts (env {CONFIG_ENV}; "
        f"default: {_home(config_path(None)[0])}).",
    )
    where.add_argument(
        "--timeout",
        type=positive_duration,
        default=timeout_s,
        help=f"How long to wait for an answer: seconds or a duration such as 30s, 2m "
        f"(default {timeout_s:g}).",
    )
    if not kubectl:
        parent.add_argument(
            "-o", "--output", choices=output.FORMATS, default="table", help="Output format."
        )
        return parent
    parent.add_argument(
        "-o",
        "--output",
        type=output.output_format,
        default="table",
        metavar="FORMAT",
        help="table (default), wide (more columns), name (kind/name lines), json, yaml, "
        "or jsonpath=TEMPLATE as kubectl's: -o jsonpath='{.items[*].name}'.",
    )
    parent.add_argument(
        "--no-headers", action="store_true", help="Tables without their header line."
    )
    return parent


@contextmanager
def connect(args: argparse.Namespace) -> Iterator[Client]:
    connection = resolve(
        server=args.server,
        token=args.token,
        context=args.context,
        config=args.cli_config,
        ca_file=args.certificate_authority,
        tls_server_name=args.tls_server_name,
    )
    with Client(
        connection.server,
        connection.token,
        timeout_s=args.timeout,
        ca_file=connection.ca_file,
        tls_server_name=connection.tls_server_name,
    ) as client:
        yield client


def _home(path: Path) -> str:
    home = os.path.expanduser("~")
    text = str(path)
    return "~" + text[len(home) :] if text.startswith(home + os.sep) else text


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value}")
    return number


_DURATION = re.compile(r"(?:\d+(?:\.\d+)?(?:ms|s|m|h|d))+")
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_s(value: str) -> float | None:
    """Seconds of a duration as Go and kubectl write them (1h30m, 90s, 1.5h, 2d, 500ms);
    None when `value` is not one."""
    if _DURATION.fullmatch(value) is None:
        return None
    return sum(float(n) * _UNIT_S[unit] for n, unit in _PART.findall(value))


def positive_duration(value: str) -> float:
    """Seconds: a plain number or a duration (30s, 2m, 1h30m)."""
    seconds = duration_s(value)
    if seconds is None:
        try:
            seconds = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not a number of seconds nor a duration (30s, 1h30m): {value!r}"
            ) from None
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"must be positive: {value}")
    return seconds


def time_arg(value: str) -> str:
    """`--since 1h30m` (that long ago) or an ISO 8601 time, which the API checks."""
    seconds = duration_s(value)
    if seconds is None:
        return value
    try:
        return (datetime.now(UTC) - timedelta(seconds=seconds)).isoformat()
    except OverflowError:
        raise argparse.ArgumentTypeError(f"too long ago: {value}") from None


def param(value: str) -> tuple[str, Any]:
    """`k=v`: v as JSON when it parses (numbers, true, null), else as a string."""
    key, sep, raw = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    try:
        return key, json.loads(raw)
    except ValueError:
        return key, raw

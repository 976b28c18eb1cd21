"""Maintenance windows from the command line: `get maintenance`, `describe maintenance`,
`create maintenance` and `delete maintenance`, over /api/v1/maintenance.

A window takes a node out for a stated time: at its start the node's job is
checkpointed and hot-swapped off it and the node cordoned; at its end the node is
uncordoned. Times are given as the API takes them (ISO 8601), or relative to now as
kubectl writes durations (`--start 2h`, `--duration 1h30m`).
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

from supervisor.ops import output
from supervisor.ops.args import duration_s, positive_duration
from supervisor.ops.client import Client, api_path
from supervisor.ops.errors import EXIT_CODES_HELP, CliError, ExitCode
from supervisor.ops.listing import show, show_list
from supervisor.ops.output import Column, field

KIND = "maintenance"
ALIASES = ["maintenance-windows", "maintenance-window", "mw"]
STATES = ("scheduled", "open")


def relative(value: Any, now: datetime | None = None) -> str:
    """An API time as how far it is from now: `in 1h30m`, `12m4s ago`."""
    if not isinstance(value, str):
        return output.text(value)
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return value
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    seconds = (parsed - (now or datetime.now(UTC))).total_seconds()
    if seconds >= 0:
        return f"in {output.duration(seconds)}"
    return f"{output.duration(-seconds)} ago"


WINDOW_COLUMNS = [
    field("ID", "id"),
    field("NODE", "node"),
    field("JOB", "job"),
    field("STATE", "state"),
    field("STARTS", "start", relative),
    field("ENDS", "end", relative),
    field("NEXT-ACTIONS", "steps"),
    Column("REASON", lambda w: output.truncated(output.text(w.get("reason") or None), 40)),
    field("START", "start", output.when, wide=True),
    field("END", "end", output.when, wide=True),
    field("NEXT-RUN", "next_run", output.when, wide=True),
]


# --- registration ----------------------------------------------------------------------


def add_get(kinds: Any, common: argparse.ArgumentParser) -> None:
    """`get maintenance` under `get`'s resources."""
    command = kinds.add_parser(
        KIND,
        aliases=ALIASES,
        parents=[common],
        help="Maintenance windows to come and open, by start.",
    )
    command.add_argument("ids", nargs="*", metavar="ID", help="Only these windows.")
    command.add_argument("--node", help="Windows on this node.")
    command.add_argument("--state", choices=STATES, help="scheduled (to come) or open (out now).")
    command.set_defaults(api_handler=_get)


def add_describe(kinds: Any, common: argparse.ArgumentParser) -> None:
    command = kinds.add_parser(KIND, aliases=ALIASES, parents=[common])
    command.add_argument("name", metavar="ID")
    command.set_defaults(api_handler=_describe, kind=KIND)


def add_create(kinds: Any, common: argparse.ArgumentParser) -> None:
    command = kinds.add_parser(
        KIND,
        aliases=ALIASES,
        parents=[common],
        epilog=EXIT_CODES_HELP,
        help="Take a node out for a stated time (POST /api/v1/maintenance).",
        description="Schedule a maintenance window: at its start the node's job is "
        "checkpointed and hot-swapped off the node and the node cordoned; at its end the "
        "node is uncordoned (back as a spare).",
    )
    command.add_argument("--node", required=True, help="The node to take out.")
    command.add_argument(
        "--start",
        type=start_arg,
        default="now",
        help="When it opens: now (default), a duration from now (30m, 2h, 1d), or an "
        "ISO 8601 time such as 2026-12-01T02:00:00Z.",
    )
    until = command.add_mutually_exclusive_group(required=True)
    until.add_argument(
        "--end",
        type=start_arg,
        help="When it closes, after --start: a duration from now (3h) or an ISO 8601 time.",
    )
    until.add_argument(
        "--duration",
        type=positive_duration,
        help="How long it lasts from --start: seconds or a duration (1h30m).",
    )
    command.add_argument("--reason", help="Why (recorded with its actions).")
    command.add_argument(
        "--idempotency-key",
        metavar="KEY",
        help="Run the command again with the same key and times: the same window, not a "
        "second one (give ISO 8601 times: a duration from now is another time each run).",
    )
    command.set_defaults(api_handler=_create)


def add_delete(kinds: Any, common: argparse.ArgumentParser) -> None:
    command = kinds.add_parser(
        KIND,
        aliases=ALIASES,
        parents=[common],
        epilog=EXIT_CODES_HELP,
        help="Cancel windows; an open one ends now (its node is uncordoned).",
    )
    command.add_argument("ids", nargs="+", metavar="ID")
    command.set_defaults(api_handler=_delete)


# --- arguments -------------------------------------------------------------------------


def start_arg(value: str) -> str:
    """`now`, a duration from now (2h, 1h30m), or an ISO 8601 time (the API checks it)."""
    if value == "now":
        return datetime.now(UTC).isoformat()
    seconds = duration_s(value)
    if seconds is None:
        return value
    try:
        return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()
    except OverflowError:
        raise argparse.ArgumentTypeError(f"too far ahead: {value}") from None


def _end_of(start: str, seconds: float) -> str:
    try:
        opens = datetime.fromisoformat(start)
    except ValueError:
        raise CliError(
            f"--start: not an ISO 8601 time: {start!r} (or give --end instead of --duration)",
            ExitCode.USAGE,
        ) from None
    if opens.tzinfo is None:
        opens = opens.replace(tzinfo=UTC)  # as the API reads a time without a zone
    try:
        return (opens + timedelta(seconds=seconds)).isoformat()
    except OverflowError:
        raise CliError(f"--duration: too long: {seconds:g}s", ExitCode.USAGE) from None


# --- handlers --------------------------------------------------------------------------


def _get(client: Client, args: argparse.Namespace) -> None:
    windows: list[dict[str, Any]] = client.get(api_path(KIND))
    if args.ids:
        by_id = {w["id"]: w for w in windows}
        missing = [i for i in args.ids if i not in by_id]
        if missing:
            raise CliError(f"maintenance window {missing[0]!r} not found", ExitCode.NOT_FOUND)
        windows = [by_id[i] for i in dict.fromkeys(args.ids)]
    windows = [
        w for w in windows if args.node in (None, w["node"]) and args.state in (None, w["state"])
    ]
    if not windows and args.output in ("table", "wide", "name"):
        print("No maintenance windows found.", file=sys.stderr)
        return
    show_list(windows, args, WINDOW_COLUMNS, KIND)


def _describe(client: Client, args: argparse.Namespace) -> None:
    window = client.get(api_path(KIND, args.name))
    if args.output not in ("table", "wide"):
        show(window, args, KIND, lambda: "")
        return
    when = {"starts": relative(window["start"]), "ends": relative(window["end"])}
    print(output.describe({**window, **when}), flush=True)


def _create(client: Client, args: argparse.Namespace) -> None:
    end = args.end if args.duration is None else _end_of(args.start, args.duration)
    body: dict[str, Any] = {"node": args.node, "start": args.start, "end": end}
    if args.reason is not None:
        body["reason"] = args.reason
    headers = {"Idempotency-Key": args.idempotency_key} if args.idempotency_key else None
    window = client.post(api_path(KIND), body, headers=headers)
    show(window, args, KIND, lambda: _created(window))


def _created(window: dict[str, Any]) -> str:
    job = f" (job {window['job']})" if window.get("job") else ""
    return (
        f"{KIND}/{window['id']} created: node {window['node']}{job} out from "
        f"{output.when(window['start'])} ({relative(window['start'])}) to "
        f"{output.when(window['end'])} ({relative(window['end'])}); {window['state']}, "
        f"next: {output.text(window['steps'])}"
    )


def _delete(client: Client, args: argparse.Namespace) -> None:
    ids = list(dict.fromkeys(args.ids))
    deleted: list[dict[str, Any]] = []
    failures: list[CliError] = []
    for window_id in ids:
        try:
            deleted.append(client.delete(api_path(KIND, window_id)))
        except CliError as exc:
            if len(ids) == 1:
                raise
            # As kubectl: the others are still deleted; each failure said, then the exit.
            failures.append(exc)
            print(f"supervisor delete: {window_id}: {exc.message}", file=sys.stderr)
    if deleted:
        data: Any = deleted if len(ids) > 1 else deleted[0]
        show(data, args, KIND, lambda: "\n".join(_deleted(w) for w in deleted))
    if failures:
        raise CliError(f"{len(failures)} of {len(ids)} windows not deleted", failures[0].code)


def _deleted(window: dict[str, Any]) -> str:
    if window["state"] == "open":
        return (
            f"{KIND}/{window['id']} deleted (it was open: node {window['node']} is uncordoned now)"
        )
    return f"{KIND}/{window['id']} deleted"

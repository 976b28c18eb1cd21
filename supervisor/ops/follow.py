"""`get -w`: the list, then one row per change as the live stream tells it, until Ctrl-C.

Events and actions come whole in the stream. A node's change is told by the events and
actions naming it: the node is read again (that one only) and printed when its row
differs from the one printed last, as kubectl prints an object each time it changes.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from supervisor.ops import output
from supervisor.ops.client import Client, StreamMessage, api_path
from supervisor.ops.errors import CliError, ExitCode
from supervisor.ops.output import Column

DROPPED = (
    "(some messages were dropped: this reader fell behind; `supervisor get events` has them all)"
)


class Printer:
    """Rows as `-o` asks, one at a time: a table keeps the widths of its first rows."""

    def __init__(self, args: argparse.Namespace, kind: str, columns: list[Column]) -> None:
        self.fmt: str = args.output
        self.kind = kind
        self.headers = not args.no_headers
        self.columns = [c for c in columns if self.fmt == "wide" or not c.wide]
        self.widths: list[int] | None = None

    def start(self, rows: list[dict[str, Any]]) -> None:
        if self.fmt in ("table", "wide"):
            cells = [[c.header for c in self.columns]] if self.headers else []
            cells += [self.cells(row) for row in rows]
            self.widths = [
                max((len(line[i]) for line in cells), default=0) for i in range(len(self.columns))
            ]
            if self.headers:
                print(self.join([c.header for c in self.columns]), flush=True)
        for row in rows:
            self.print(row)

    def cells(self, row: Mapping[str, Any]) -> list[str]:
        return [c.value(row) for c in self.columns]

    def join(self, cells: list[str]) -> str:
        widths = self.widths or [0] * len(cells)
        return output.GAP.join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    def line(self, row: Mapping[str, Any]) -> str:
        if self.fmt in ("table", "wide"):
            return self.join(self.cells(row))
        if self.fmt == "name":
            return output.names(dict(row), self.kind)
        if self.fmt == "json":
            return output.json_line(row)  # one object per line, for jq
        if self.fmt == "yaml":
            return "---\n" + output.dump(dict(row), "yaml")
        return output.dump(dict(row), self.fmt)

    def print(self, row: Mapping[str, Any]) -> None:
        print(self.line(row), flush=True)


def stream(
    client: Client,
    on_open: Callable[[], None],
    on_message: Callable[[StreamMessage], None],
    on_resync: Callable[[], None],
) -> None:
    """Open the live stream, then `on_open` (the list: read once the stream is open, so
    that nothing happening between the two is missed), then each message, until Ctrl-C."""
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C (SIGINT) stops a watch, as kubectl's, even where the process was started
        # with SIGINT ignored (a background job of a script: Python then leaves it
        # ignored, and the SIGINT sent to stop the watch did nothing).
        signal.signal(signal.SIGINT, signal.default_int_handler)
    first = True
    try:
        for message in client.stream(api_path("stream"), on_open):
            if message.kind == "resync":
                # The first one only says "nothing to replay"; a later one that this
                # reader fell behind and the server dropped what it had not read.
                if not first:
                    print(DROPPED, file=sys.stderr, flush=True)
                    on_resync()
            else:
                on_message(message)
            first = False
    except KeyboardInterrupt:
        pass  # what the user asked for: stop watching


def _matches(record: Mapping[str, Any], params: Mapping[str, Any]) -> bool:
    types = params.get("type")
    if types and record.get("type") not in types:
        return False
    for key in ("node", "job", "status", "event_id"):
        wanted = params.get(key)
        if wanted is not None and record.get(key) != wanted:
            return False
    return True


def follow_records(
    client: Client,
    args: argparse.Namespace,
    kind: str,
    listed: Callable[[], list[dict[str, Any]]],
    columns: list[Column],
    params: Mapping[str, Any],
) -> None:
    """Events or actions: the list (`listed`, oldest first), then each new one (each
    change of an action) that passes the same filters. What the stream tells of a record
    the list showed is printed only when it is newer than what the list showed."""
    printer = Printer(args, kind, columns)
    listed_status: dict[Any, Any] = {}  # id -> the status the list showed (events: None)

    def opened() -> None:
        items = listed()
        printer.start(items)
        listed_status.update((item.get("id"), item.get("status")) for item in items)

    def on_message(message: StreamMessage) -> None:
        if message.kind != kind or not _matches(message.data, params):
            return
        key, status = message.data.get("id"), message.data.get("status")
        if key in listed_status:
            if _progress(status) <= _progress(listed_status[key]):
                return  # the list showed it, or a later state of it
            listed_status[key] = status
        printer.print(message.data)

    stream(client, opened, on_message, lambda: None)


#: How far along an action is, by status: a stream message older than the list's row is
#: not printed after it.
_PROGRESS = {"pending": 1, "running": 2, "succeeded": 3, "failed": 3}


def _progress(status: Any) -> int:
    return _PROGRESS.get(status, 0) if isinstance(status, str) else 0


def follow_nodes(
    client: Client,
    args: argparse.Namespace,
    listed: Callable[[], list[dict[str, Any]]],
    columns: list[Column],
) -> None:
    printer = Printer(args, "node", columns)
    shown: dict[str, str] = {}
    names = set(args.names)

    def opened() -> None:
        nodes = listed()
        printer.start(nodes)
        shown.update((node["name"], printer.line(node)) for node in nodes)

    def wanted(node: Mapping[str, Any]) -> bool:
        if names and node["name"] not in names:
            return False
        if node["name"] in shown:  # followed once shown, into any state
            return True
        return (
            (not args.statuses or node["status"] in args.statuses)
            and (args.state is None or node["state"] == args.state)
            and (args.job is None or node["job"] == args.job)
            and (args.alive is None or node["alive"] is args.alive)
        )

    def changed(node: dict[str, Any]) -> None:
        if not wanted(node):
            return
        line = printer.line(node)
        if shown.get(node["name"]) != line:
            shown[node["name"]] = line
            print(line, flush=True)

    def on_message(message: StreamMessage) -> None:
        name = message.data.get("node") if isinstance(message.data, dict) else None
        if not name or (names and name not in names):
            return
        try:
            changed(client.get(api_path("nodes", name)))
        except CliError as exc:
            if exc.code is not ExitCode.NOT_FOUND:
                raise

    def on_resync() -> None:
        for node in client.get(api_path("nodes")):
            changed(node)

    stream(client, opened, on_message, on_resync)

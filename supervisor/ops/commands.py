"""The operator subcommands: their arguments, and what each asks the API and prints."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from supervisor.ops import output
from supervisor.ops.budget import add_reset_budget
from supervisor.ops.client import Client, StreamMessage, api_path
from supervisor.ops.config import (
    CA_ENV,
    CONFIG_ENV,
    SERVER_ENV,
    TOKEN_ENV,
    ConfigFile,
    Context,
    check_server,
    config_path,
    resolve,
)
from supervisor.ops.errors import EXIT_CODES_HELP, CliError, ExitCode
from supervisor.ops.output import Column, field

COMMANDS = frozenset(
    {"get", "describe", "inject", "end", "cordon", "uncordon", "reset-budget", "watch", "config"}
)

ApiHandler = Callable[[Client, argparse.Namespace], None]
#: Events shown under a node or job described.
RELATED_EVENTS = 10


# --- options shared by every command that talks to a server ---------------------------


def connection_options(
    *, url_alias: bool = False, timeout_s: float = 10.0
) -> argparse.ArgumentParser:
    """A parent parser: where the server is, and how output is printed."""
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
        type=_positive_float,
        default=timeout_s,
        help=f"Seconds to wait for an answer (default {timeout_s:g}).",
    )
    parent.add_argument(
        "-o", "--output", choices=output.FORMATS, default="table", help="Output format."
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


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value}")
    return number


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {value}")
    return number


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _time_arg(value: str) -> str:
    """`--since 10m` (ago) or an ISO 8601 time, which the API checks."""
    match = _DURATION.match(value)
    if match is None:
        return value
    try:
        return (
            datetime.now(UTC) - timedelta(seconds=float(match[1]) * _UNIT_S[match[2]])
        ).isoformat()
    except OverflowError:
        raise argparse.ArgumentTypeError(f"too long ago: {value}") from None


def _param(value: str) -> tuple[str, Any]:
    """`k=v`: v as JSON when it parses (numbers, true, null), else as a string."""
    key, sep, raw = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    try:
        return key, json.loads(raw)
    except ValueError:
        return key, raw


# --- registration ----------------------------------------------------------------------


def add_commands(sub: Any) -> None:
    """Add the operator subcommands to the `supervisor` parser's subparsers."""
    common = connection_options()
    _add_get(sub, common)
    _add_describe(sub, common)

    inject = _command(
        sub,
        "inject",
        parents=[common],
        help="Inject a fault (POST /api/v1/faults; the server needs enable_fault_injection).",
        description="Inject a fault. KIND: heartbeat_loss, xid, ecc, node_down, worker_crash, "
        "worker_hang, straggler (as the server's backend allows), or `schedule` with "
        "--param schedule=KIND,MEAN_INTERVAL_S.",
    )
    inject.add_argument("kind", metavar="KIND")
    inject.add_argument("--node", help="Node to hit.")
    inject.add_argument("--job", help="Job whose nodes a schedule targets.")
    inject.add_argument(
        "--param",
        dest="params",
        type=_param,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="A field of the fault: code=79 (xid), count=2 (ecc), duration_s=30, slowdown=0.5, "
        "rank=0, gpu=1. Repeat for several.",
    )
    inject.set_defaults(api_handler=_inject)

    end = _command(sub, "end", parents=[common], help="End an active fault.")
    end.add_argument("fault_id", metavar="FAULT_ID")
    end.set_defaults(api_handler=_end)

    for name, verb in (("cordon", "Keep new work off a node"), ("uncordon", "Undo a cordon")):
        command = _command(
            sub, name, parents=[common], help=f"{verb} (an operator action, POST /api/v1/actions)."
        )
        command.add_argument("node", metavar="NODE")
        command.add_argument("--reason", help="Recorded with the action.")
        command.set_defaults(api_handler=_node_action, action_type=name)

    add_reset_budget(sub, common, EXIT_CODES_HELP)

    watch = _command(
        sub,
        "watch",
        parents=[common],
        help="Follow live events and action changes, one line each, until Ctrl-C.",
    )
    watch.set_defaults(api_handler=_watch)

    _add_config(sub)


def _command(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(name, epilog=EXIT_CODES_HELP, **kwargs)
    return parser


def _add_get(sub: Any, common: argparse.ArgumentParser) -> None:
    get = _command(sub, "get", help="List nodes, jobs, events, actions or faults.")
    kinds = get.add_subparsers(dest="resource", required=True, metavar="RESOURCE")

    nodes = kinds.add_parser("nodes", aliases=["node"], parents=[common], help="Nodes, by name.")
    nodes.add_argument("--state", help="running, spare, failed, complete, undefined.")
    nodes.add_argument("--job", help="Nodes of this job.")
    liveness = nodes.add_mutually_exclusive_group()
    liveness.add_argument("--alive", dest="alive", action="store_const", const=True)
    liveness.add_argument(
        "--dead", dest="alive", action="store_const", const=False, help="Heartbeat lost."
    )
    nodes.set_defaults(api_handler=_get_nodes)

    jobs = kinds.add_parser("jobs", aliases=["job"], parents=[common], help="Jobs, by name.")
    jobs.set_defaults(api_handler=_get_jobs)

    for name, handler in (("events", _get_events), ("actions", _get_actions)):
        command = kinds.add_parser(
            name, aliases=[name[:-1]], parents=[common], help=f"{name.title()}, newest first."
        )
        command.add_argument(
            "--type", dest="types", action="append", help="Of this type; repeat for several."
        )
        command.add_argument("--node", help="On this node.")
        command.add_argument("--job", help="Of this job.")
        if name == "actions":
            command.add_argument("--status", help="pending, running, succeeded or failed.")
            command.add_argument("--event", type=_positive_int, help="Taken for this event.")
        command.add_argument(
            "--since", type=_time_arg, help="At or after: a duration ago (30s, 10m, 2h, 1d) "
            "or an ISO 8601 time."
        )  # fmt: skip
        command.add_argument("--until", type=_time_arg, help="Before (as --since).")
        command.add_argument(
            "--limit", type=_positive_int, default=50, help="At most this many (default 50)."
        )
        command.set_defaults(api_handler=handler)

    faults = kinds.add_parser(
        "faults", aliases=["fault"], parents=[common], help="Faults injected, newest first."
    )
    activity = faults.add_mutually_exclusive_group()
    activity.add_argument("--active", dest="active", action="store_const", const=True)
    activity.add_argument("--ended", dest="active", action="store_const", const=False)
    faults.set_defaults(api_handler=_get_faults)


def _add_describe(sub: Any, common: argparse.ArgumentParser) -> None:
    describe = _command(
        sub,
        "describe",
        help="One node, job, event, action or fault in full, with what relates to it.",
    )
    kinds = describe.add_subparsers(dest="resource", required=True, metavar="RESOURCE")
    for kind, handler, what in (
        ("node", _describe_node, "NAME"),
        ("job", _describe_job, "NAME"),
        ("event", _describe_event, "ID"),
        ("action", _describe_action, "ID"),
        ("fault", _describe_fault, "ID"),
    ):
        command = kinds.add_parser(kind, aliases=[f"{kind}s"], parents=[common])
        command.add_argument("name", metavar=what)
        command.set_defaults(api_handler=handler)


def _add_config(sub: Any) -> None:
    config = _command(sub, "config", help="Contexts: which server and token the commands use.")
    commands = config.add_subparsers(dest="config_command", required=True, metavar="COMMAND")
    file_option = argparse.ArgumentParser(add_help=False)
    file_option.add_argument(
        "--config", dest="cli_config", metavar="FILE", help=f"Config file (env {CONFIG_ENV})."
    )

    listing = commands.add_parser(
        "get-contexts", parents=[file_option], help="List the contexts; * marks the current one."
    )
    listing.add_argument("-o", "--output", choices=output.FORMATS, default="table")
    listing.set_defaults(config_handler=_get_contexts)

    use = commands.add_parser(
        "use-context", parents=[file_option], help="Make a context the current one."
    )
    use.add_argument("name", metavar="NAME")
    use.set_defaults(config_handler=_use_context)

    put = commands.add_parser(
        "set-context",
        parents=[file_option],
        help="Add a context or change one (the first one added becomes current).",
    )
    put.add_argument("name", metavar="NAME")
    put.add_argument("--server", help="Supervisor URL (required for a new context).")
    token = put.add_mutually_exclusive_group()
    token.add_argument("--token", help="Operator token, stored in the file.")
    token.add_argument("--token-file", help="File holding the operator token.")
    put.add_argument(
        "--certificate-authority",
        metavar="FILE",
        help="CA bundle (PEM) that verifies the server (https://); its path is stored.",
    )
    put.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="Name the server's certificate is checked against instead of the URL's host.",
    )
    put.set_defaults(config_handler=_set_context)


# --- running ---------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Run an operator subcommand; the exit code (see errors.ExitCode)."""

    def act() -> None:
        if hasattr(args, "config_handler"):
            args.config_handler(args)
            return
        handler: ApiHandler = args.api_handler
        with connect(args) as client:
            handler(client, args)

    return guarded(args.command, act)


def guarded(command: str, act: Callable[[], None]) -> int:
    """Run `act`: a CliError becomes one line on stderr and its exit code."""
    try:
        act()
    except CliError as exc:
        print(f"supervisor {command}: {exc.message}", file=sys.stderr)
        return exc.code
    except BrokenPipeError:
        # The reader went away (`| head`): not an error. Point stdout at /dev/null so
        # that Python's flush at exit does not fail on the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return ExitCode.OK


def _show(data: Any, args: argparse.Namespace, as_text: Callable[[], str]) -> None:
    print(as_text() if args.output == "table" else output.dump(data, args.output), flush=True)


def _show_list(
    items: list[dict[str, Any]], args: argparse.Namespace, columns: list[Column], what: str
) -> None:
    if args.output == "table" and not items:
        print(f"No {what} found.", file=sys.stderr)
        return
    _show(items, args, lambda: output.table(items, columns))


# --- get -------------------------------------------------------------------------------


def _workers(node: output.Row) -> str:
    workers = node.get("workers") or []
    running = sum(1 for w in workers if w.get("state") == "running")
    return f"{running}/{len(workers)}"


NODE_COLUMNS = [
    field("NAME", "name"),
    field("STATE", "state"),
    field("JOB", "job"),
    field("ALIVE", "alive"),
    field("CORDONED", "cordoned"),
    field("FLAPPING", "flapping"),
    Column("WORKERS", _workers),
    field("LAST-HEARTBEAT", "heartbeat_age_s", output.duration),
]
JOB_COLUMNS = [
    field("NAME", "name"),
    field("STATE", "state"),
    Column(
        "REPLICAS",
        lambda j: f"{j['num_dp_replicas']} ({j['min_num_dp_replicas']}-{j['max_num_dp_replicas']})",
    ),
    field("NODES-PER-REPLICA", "num_nodes_per_dp"),
    Column("NODES", lambda j: str(len(j["nodes"]))),
    field("LAST-STEP", "last_step"),
    field("HANG-TIMEOUT", "hang_timeout_s", output.duration),
]
EVENT_COLUMNS = [
    field("ID", "id"),
    field("TIME", "time", output.when),
    field("TYPE", "type"),
    field("NODE", "node"),
    field("JOB", "job"),
    field("RANK", "rank"),
    field("FAULT", "fault_id"),
    Column("DETAILS", lambda e: output.truncated(output.text(e["details"]), 60)),
]
ACTION_COLUMNS = [
    field("ID", "id"),
    field("CREATED", "created_at", output.when),
    field("TYPE", "type"),
    field("STATUS", "status"),
    field("NODE", "node"),
    field("JOB", "job"),
    field("SOURCE", "source"),
    field("EVENT", "event_id"),
    field("ATTEMPTS", "attempts"),
    field("DURATION", "duration_s", output.duration),
    Column("REASON", lambda a: output.truncated(output.text(a["error"] or a["reason"]), 50)),
]
FAULT_COLUMNS = [
    field("ID", "id"),
    field("KIND", "kind"),
    field("NODE", "node"),
    field("JOB", "job"),
    field("ACTIVE", "active"),
    field("CREATED", "created_at", output.when),
    field("ENDED", "ended_at", output.when),
    Column("PARAMS", lambda f: output.truncated(output.text(f["params"]), 50)),
]


def _get_nodes(client: Client, args: argparse.Namespace) -> None:
    nodes = client.get(
        api_path("nodes"), {"state": args.state, "job": args.job, "alive": _flag(args.alive)}
    )
    _show_list(nodes, args, NODE_COLUMNS, "nodes")


def _flag(value: bool | None) -> str | None:
    return None if value is None else str(value).lower()


def _get_jobs(client: Client, args: argparse.Namespace) -> None:
    _show_list(client.get(api_path("jobs")), args, JOB_COLUMNS, "jobs")


def _get_events(client: Client, args: argparse.Namespace) -> None:
    params = {
        "type": args.types,
        "node": args.node,
        "job": args.job,
        "since": args.since,
        "until": args.until,
    }
    events = client.pages(api_path("events"), params, args.limit)
    _show_list(events, args, EVENT_COLUMNS, "events")


def _get_actions(client: Client, args: argparse.Namespace) -> None:
    params = {
        "type": args.types,
        "status": args.status,
        "node": args.node,
        "job": args.job,
        "event_id": args.event,
        "since": args.since,
        "until": args.until,
    }
    actions = client.pages(api_path("actions"), params, args.limit)
    _show_list(actions, args, ACTION_COLUMNS, "actions")


def _get_faults(client: Client, args: argparse.Namespace) -> None:
    faults = client.get(api_path("faults"), {"active": _flag(args.active)})
    _show_list(faults, args, FAULT_COLUMNS, "faults")


# --- describe --------------------------------------------------------------------------


def _describe(
    client: Client,
    args: argparse.Namespace,
    path: str,
    related: Callable[[dict[str, Any]], list[tuple[str, str]]] | None = None,
) -> None:
    obj = client.get(path)
    if args.output != "table":
        _show(obj, args, lambda: "")
        return
    sections = [output.describe(obj)]
    for title, body in related(obj) if related is not None else []:
        sections.append(f"{title}:\n{output.indented(body, 2)}")
    print("\n".join(sections), flush=True)


def _recent_events(client: Client, **target: str) -> list[tuple[str, str]]:
    events = client.get(api_path("events"), {**target, "limit": RELATED_EVENTS})["items"]
    body = output.table(events, EVENT_COLUMNS) if events else "none"
    return [(f"Recent events (newest {RELATED_EVENTS})", body)]


def _describe_node(client: Client, args: argparse.Namespace) -> None:
    _describe(
        client, args, api_path("nodes", args.name), lambda n: _recent_events(client, node=n["name"])
    )


def _describe_job(client: Client, args: argparse.Namespace) -> None:
    def related(job: dict[str, Any]) -> list[tuple[str, str]]:
        nodes = client.get(api_path("nodes"), {"job": job["name"]})
        body = output.table(nodes, NODE_COLUMNS) if nodes else "none"
        return [("Nodes", body), *_recent_events(client, job=job["name"])]

    _describe(client, args, api_path("jobs", args.name), related)


def _describe_event(client: Client, args: argparse.Namespace) -> None:
    def related(event: dict[str, Any]) -> list[tuple[str, str]]:
        actions = client.get(api_path("actions"), {"event_id": event["id"]})["items"]
        return [("Actions", output.table(actions, ACTION_COLUMNS) if actions else "none")]

    _describe(client, args, api_path("events", args.name), related)


def _describe_action(client: Client, args: argparse.Namespace) -> None:
    _describe(client, args, api_path("actions", args.name))


def _describe_fault(client: Client, args: argparse.Namespace) -> None:
    _describe(client, args, api_path("faults", args.name))


# --- acting ----------------------------------------------------------------------------


def _inject(client: Client, args: argparse.Namespace) -> None:
    body: dict[str, Any] = dict(args.params)
    if args.kind != "schedule":  # a schedule is its own field, not a kind
        body["kind"] = args.kind
    for key in ("node", "job"):
        if getattr(args, key) is not None:
            body[key] = getattr(args, key)
    fault = client.post(api_path("faults"), body)
    caused = ",".join(str(e) for e in fault["events"]) or "none yet"
    _show(
        fault,
        args,
        lambda: f"fault {fault['id']} injected: {_fault_summary(fault)} (events: {caused})",
    )


def _fault_summary(fault: dict[str, Any]) -> str:
    target = [f"{k}={fault[k]}" for k in ("node", "job") if fault.get(k)]
    return " ".join([fault["kind"], *target])


def _end(client: Client, args: argparse.Namespace) -> None:
    fault = client.delete(api_path("faults", args.fault_id))
    _show(fault, args, lambda: f"fault {fault['id']} ended: {_fault_summary(fault)}")


def _node_action(client: Client, args: argparse.Namespace) -> None:
    body: dict[str, Any] = {"type": args.action_type, "node": args.node}
    if args.reason is not None:
        body["reason"] = args.reason
    action = client.post(api_path("actions"), body)
    _show(
        action,
        args,
        lambda: (
            f"action {action['id']}: {action['type']} node {action['node']}, "
            f"{action['status']} (supervisor describe action {action['id']})"
        ),
    )


# --- watch -----------------------------------------------------------------------------


def _watch(client: Client, args: argparse.Namespace) -> None:
    def opened() -> None:
        print(f"watching {client.server} (Ctrl-C to stop)", file=sys.stderr, flush=True)

    first = True
    try:
        for message in client.stream(api_path("stream"), on_open=opened):
            if message.kind == "resync":
                # The first one only says "nothing to replay"; a later one that this
                # reader fell behind and the server dropped what it had not read.
                if not first:
                    print(
                        "(some messages were dropped: this reader fell behind; "
                        "`supervisor get events` has them all)",
                        file=sys.stderr,
                        flush=True,
                    )
            elif message.kind in ("event", "action"):
                print(_watch_line(message, args.output), flush=True)
            first = False
    except KeyboardInterrupt:
        pass  # what the user asked for: stop watching


def _watch_line(message: StreamMessage, fmt: output.Format) -> str:
    record = {"kind": message.kind, **message.data}
    if fmt == "json":
        return json.dumps(record, ensure_ascii=False)  # one object per line, for jq
    if fmt == "yaml":
        return "---\n" + output.dump(record, "yaml")
    data = message.data
    if message.kind == "event":
        details = output.truncated(output.text(data.get("details") or None), 100)
        at, what, extra = data["time"], data["type"], details
    else:
        at = data.get("finished_at") or data.get("started_at") or data["created_at"]
        what, extra = f"{data['type']} {data['status']}", output.text(data.get("error"))
    target = " ".join(f"{k}={data[k]}" for k in ("node", "job") if data.get(k))
    tail = " ".join(part for part in (target, "" if extra == "-" else extra) if part)
    return f"{output.when(at)}  {message.kind:<6}  #{data['id']:<5} {what:<32} {tail}".rstrip()


# --- config ----------------------------------------------------------------------------


def _config_file(args: argparse.Namespace, *, must_exist: bool) -> ConfigFile:
    path, named = config_path(args.cli_config)
    return ConfigFile.load(path, must_exist=must_exist and named)


def _get_contexts(args: argparse.Namespace) -> None:
    file = _config_file(args, must_exist=True)
    rows = [
        {
            "current": c.name == file.current_context,
            "name": c.name,
            "server": c.server,
            "auth": "token" if c.token else f"token-file {c.token_file}" if c.token_file else None,
        }
        for c in file.contexts
    ]
    columns = [
        Column("CURRENT", lambda r: "*" if r["current"] else ""),
        field("NAME", "name"),
        field("SERVER", "server"),
        field("AUTH", "auth"),
    ]
    if args.output == "table" and not rows:
        print(f"No contexts in {file.path}.", file=sys.stderr)
        return
    # Never print the tokens themselves: this output ends up in terminals and tickets.
    _show(rows, args, lambda: output.table(rows, columns))


def _use_context(args: argparse.Namespace) -> None:
    file = _config_file(args, must_exist=True)
    file.find(args.name)
    file.current_context = args.name
    file.save()
    print(f"switched to context {args.name!r}")


def _set_context(args: argparse.Namespace) -> None:
    file = _config_file(args, must_exist=False)
    try:
        old: Context | None = file.find(args.name)
    except CliError:
        old = None
    server = args.server or (old.server if old else None)
    if server is None:
        raise CliError(f"context {args.name!r} is new: give --server", ExitCode.USAGE)
    token, token_file = (old.token, old.token_file) if old else (None, None)
    if args.token is not None or args.token_file is not None:
        token, token_file = args.token, args.token_file
    ca = old.certificate_authority if old else None
    if args.certificate_authority is not None:
        # Absolute: a relative path in the file is read relative to the file.
        ca = os.path.abspath(os.path.expanduser(args.certificate_authority))
    server_name = args.tls_server_name or (old.tls_server_name if old else None)
    file.put(Context(args.name, check_server(server), token, token_file, ca, server_name))
    if file.current_context is None:
        file.current_context = args.name
    file.save()
    print(f"context {args.name!r} {'changed' if old else 'added'} in {file.path}")

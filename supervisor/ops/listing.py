"""`supervisor get` and `describe`: the objects of the API as tables (kubectl's columns
and AGE), names, JSON, YAML or a jsonpath template; `get -w` follows the live stream."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from supervisor.ops import output
from supervisor.ops.args import positive_int, time_arg
from supervisor.ops.client import Client, api_path
from supervisor.ops.errors import EXIT_CODES_HELP, CliError, ExitCode
from supervisor.ops.output import Column, field

#: Events shown under a node or job described.
RELATED_EVENTS = 10
#: What `get nodes --status` takes (the API's node statuses).
NODE_STATUSES = ("lost", "failed", "draining", "cordoned", "spare", "running", "complete")


def _command(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(name, epilog=EXIT_CODES_HELP, **kwargs)
    return parser


def _watchable(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-w",
        "--watch",
        action="store_true",
        help="After the list, print each change as it happens (from the live stream), "
        "until Ctrl-C.",
    )


def add_get(sub: Any, common: argparse.ArgumentParser) -> Any:
    """`get`; its resources' subparsers, for the resources other modules add."""
    get = _command(
        sub, "get", help="List nodes, jobs, events, actions, faults or maintenance windows."
    )
    kinds = get.add_subparsers(dest="resource", required=True, metavar="RESOURCE")

    nodes = kinds.add_parser("nodes", aliases=["node", "no"], parents=[common], help="Nodes.")
    nodes.add_argument("names", nargs="*", metavar="NAME", help="Only these nodes.")
    nodes.add_argument(
        "--status",
        dest="statuses",
        action="append",
        choices=NODE_STATUSES,
        help="What the node is now; repeat for several.",
    )
    nodes.add_argument("--state", help="As its host monitor reports: running, spare, failed, ...")
    nodes.add_argument("--job", help="Nodes of this job.")
    liveness = nodes.add_mutually_exclusive_group()
    liveness.add_argument("--alive", dest="alive", action="store_const", const=True)
    liveness.add_argument(
        "--dead", dest="alive", action="store_const", const=False, help="Heartbeat lost."
    )
    _watchable(nodes)
    nodes.set_defaults(api_handler=_get_nodes)

    jobs = kinds.add_parser("jobs", aliases=["job"], parents=[common], help="Jobs, by name.")
    jobs.add_argument("names", nargs="*", metavar="NAME", help="Only these jobs.")
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
            command.add_argument("--event", type=positive_int, help="Taken for this event.")
        command.add_argument(
            "--since", type=time_arg, help="At or after: a duration ago (30s, 10m, 1h30m, "
            "2d) or an ISO 8601 time."
        )  # fmt: skip
        command.add_argument("--until", type=time_arg, help="Before (as --since).")
        command.add_argument(
            "--limit", type=positive_int, default=50, help="At most this many (default 50)."
        )
        _watchable(command)
        command.set_defaults(api_handler=handler)

    faults = kinds.add_parser(
        "faults", aliases=["fault"], parents=[common], help="Faults injected, newest first."
    )
    activity = faults.add_mutually_exclusive_group()
    activity.add_argument("--active", dest="active", action="store_const", const=True)
    activity.add_argument("--ended", dest="active", action="store_const", const=False)
    faults.set_defaults(api_handler=_get_faults)
    return kinds


def add_describe(sub: Any, common: argparse.ArgumentParser) -> Any:
    describe = _command(
        sub,
        "describe",
        help="One node, job, event, action, fault or maintenance window in full, with what "
        "relates to it.",
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
        command.set_defaults(api_handler=handler, kind=kind)
    return kinds


# --- printing ------------------------------------------------------------------------------


def show(data: Any, args: argparse.Namespace, kind: str, as_text: Callable[[], str]) -> None:
    """One object or a list, as `-o` asks."""
    fmt: str = args.output
    if fmt in ("table", "wide"):
        text = as_text()
    elif fmt == "name":
        text = output.names(data, kind)
    else:
        text = output.dump(data, fmt)
    print(text, flush=True)


def show_list(
    items: list[dict[str, Any]], args: argparse.Namespace, columns: list[Column], kind: str
) -> None:
    if args.output in ("table", "wide", "name") and not items:
        print(f"No {kind}s found.", file=sys.stderr)
        return
    show(items, args, kind, lambda: _table(items, columns, args))


def _table(rows: list[dict[str, Any]], columns: list[Column], args: argparse.Namespace) -> str:
    wide = getattr(args, "output", "table") == "wide"
    return output.table(rows, columns, wide=wide, headers=not getattr(args, "no_headers", False))


# --- columns -------------------------------------------------------------------------------


def _workers(node: output.Row) -> str:
    workers = node.get("workers") or []
    running = sum(1 for w in workers if w.get("state") == "running")
    return f"{running}/{len(workers)}"


def _marks(node: output.Row) -> str:
    marks = []
    for mark in node.get("marks") or []:
        clears = node.get("flapping_clears_in_s")
        if mark == "flapping" and clears is not None:
            mark = f"flapping(clears in {output.duration(clears)})"
        marks.append(mark)
    if node.get("dry_run_cordoned"):
        marks.append("dry-run:would-cordon")
    return ",".join(marks) or "-"


def _action_status(action: output.Row) -> str:
    """An action's status, marked when a dry run recorded it (nothing was done); one
    word, so that scripts splitting the table on blanks keep their columns."""
    return f"{action['status']}(dry-run)" if action.get("dry_run") else str(action["status"])


NODE_COLUMNS = [
    field("NAME", "name"),
    field("STATUS", "status"),
    field("JOB", "job"),
    Column("MARKS", _marks),
    Column("WORKERS", _workers),
    field("HEARTBEAT", "heartbeat_age_s", output.duration),
    field("REPORTED", "state", wide=True),
    field("ALIVE", "alive", wide=True),
    field("CORDONED", "cordoned", wide=True),
    field("LAST-HEARTBEAT", "last_heartbeat", output.when, wide=True),
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
    field("GIVEN-UP", "given_up_reason", wide=True),
]
EVENT_COLUMNS = [
    field("ID", "id"),
    field("AGE", "time", output.age),
    field("TYPE", "type"),
    field("NODE", "node"),
    field("JOB", "job"),
    field("RANK", "rank"),
    field("FAULT", "fault_id"),
    Column("DETAILS", lambda e: output.truncated(output.text(e["details"]), 60)),
    field("TIME", "time", output.when, wide=True),
    field("INCIDENT", "incident_action_id", wide=True),
]
ACTION_COLUMNS = [
    field("ID", "id"),
    field("AGE", "created_at", output.age),
    field("TYPE", "type"),
    Column("STATUS", _action_status),
    field("NODE", "node"),
    field("JOB", "job"),
    field("SOURCE", "source"),
    field("EVENT", "event_id"),
    field("ATTEMPTS", "attempts"),
    field("DURATION", "duration_s", output.duration),
    Column("REASON", lambda a: output.truncated(output.text(a["error"] or a["reason"]), 50)),
    field("CREATED", "created_at", output.when, wide=True),
    field("DRY-RUN", "dry_run", wide=True),
]
FAULT_COLUMNS = [
    field("ID", "id"),
    field("KIND", "kind"),
    field("NODE", "node"),
    field("JOB", "job"),
    field("ACTIVE", "active"),
    field("AGE", "created_at", output.age),
    Column("PARAMS", lambda f: output.truncated(output.text(f["params"]), 50)),
    field("CREATED", "created_at", output.when, wide=True),
    field("ENDED", "ended_at", output.when, wide=True),
]


# --- get -----------------------------------------------------------------------------------


def _flag(value: bool | None) -> str | None:
    return None if value is None else str(value).lower()


def _only(items: list[dict[str, Any]], names: list[str], kind: str) -> list[dict[str, Any]]:
    """The items named, in the order given; NOT_FOUND naming the first that is not."""
    if not names:
        return items
    by_name = {item["name"]: item for item in items}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise CliError(f"{kind} {missing[0]!r} not found", ExitCode.NOT_FOUND)
    return [by_name[n] for n in dict.fromkeys(names)]


def _node_params(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "status": args.statuses,
        "state": args.state,
        "job": args.job,
        "alive": _flag(args.alive),
    }


def _get_nodes(client: Client, args: argparse.Namespace) -> None:
    def listed() -> list[dict[str, Any]]:
        return _only(client.get(api_path("nodes"), _node_params(args)), args.names, "node")

    if not args.watch:
        show_list(listed(), args, NODE_COLUMNS, "node")
        return
    from supervisor.ops.follow import follow_nodes  # only a watch needs it

    follow_nodes(client, args, listed, NODE_COLUMNS)


def _get_jobs(client: Client, args: argparse.Namespace) -> None:
    jobs = _only(client.get(api_path("jobs")), args.names, "job")
    show_list(jobs, args, JOB_COLUMNS, "job")


def _get_events(client: Client, args: argparse.Namespace) -> None:
    params = {
        "type": args.types,
        "node": args.node,
        "job": args.job,
        "since": args.since,
        "until": args.until,
    }
    _listed(client, args, "event", params, EVENT_COLUMNS)


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
    _listed(client, args, "action", params, ACTION_COLUMNS)


def _listed(
    client: Client,
    args: argparse.Namespace,
    kind: str,
    params: dict[str, Any],
    columns: list[Column],
) -> None:
    def listed() -> list[dict[str, Any]]:
        return client.pages(api_path(f"{kind}s"), params, args.limit)

    if not args.watch:
        show_list(listed(), args, columns, kind)
        return
    from supervisor.ops.follow import follow_records

    # Oldest first, as they happened: what follows comes below.
    follow_records(client, args, kind, lambda: listed()[::-1], columns, params)


def _get_faults(client: Client, args: argparse.Namespace) -> None:
    faults = client.get(api_path("faults"), {"active": _flag(args.active)})
    show_list(faults, args, FAULT_COLUMNS, "fault")


# --- describe ------------------------------------------------------------------------------


def _describe(
    client: Client,
    args: argparse.Namespace,
    path: str,
    related: Callable[[dict[str, Any]], list[tuple[str, str]]] | None = None,
) -> None:
    obj = client.get(path)
    if args.output not in ("table", "wide"):
        show(obj, args, args.kind, lambda: "")
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

"""The operator subcommands: their arguments, and what each asks the API and prints."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from resiliency_protocol.faults import FAULTS
from supervisor.ops import completion, drills, follow, listing, maintenance, output
from supervisor.ops.args import connect as connect  # the online goodput commands use them
from supervisor.ops.args import connection_options as connection_options
from supervisor.ops.args import param
from supervisor.ops.budget import add_reset_budget
from supervisor.ops.client import Client, StreamMessage, api_path
from supervisor.ops.config import (
    CONFIG_ENV,
    ConfigFile,
    Context,
    check_server,
    config_path,
)
from supervisor.ops.errors import EXIT_CODES_HELP, CliError, ExitCode
from supervisor.ops.output import Column, field

COMMANDS = frozenset(
    {
        "get",
        "describe",
        "create",
        "delete",
        "inject",
        "end",
        "cordon",
        "uncordon",
        "reset-budget",
        "watch",
        "config",
        "completion",
    }
)

ApiHandler = Callable[[Client, argparse.Namespace], None]


# --- registration ----------------------------------------------------------------------


def add_commands(sub: Any) -> None:
    """Add the operator subcommands to the `supervisor` parser's subparsers."""
    common = connection_options()
    objects = connection_options(kubectl=True)
    got, described = listing.add_get(sub, objects), listing.add_describe(sub, objects)
    maintenance.add_get(got, objects)
    drills.add_get(got, objects)
    maintenance.add_describe(described, objects)
    create = _resources(sub, "create", "Create a maintenance window or a fault drill.")
    maintenance.add_create(create, objects)
    drills.add_create(create, objects)
    delete = _resources(
        sub, "delete", "Delete maintenance windows (an open one ends now) or drills."
    )
    maintenance.add_delete(delete, objects)
    drills.add_delete(delete, objects)

    inject = _command(
        sub,
        "inject",
        parents=[common],
        help="Inject a fault (POST /api/v1/faults; the server needs enable_fault_injection).",
        description=f"Inject a fault. KIND: {', '.join(FAULTS)} (as the server's backend "
        "allows), or `schedule` with --param schedule=KIND,MEAN_INTERVAL_S.",
    )
    inject.add_argument("kind", metavar="KIND")
    inject.add_argument("--node", help="Node to hit.")
    inject.add_argument("--job", help="Job whose nodes a schedule targets.")
    inject.add_argument(
        "--param",
        dest="params",
        type=param,
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
        help="Follow live events and action changes, one line each, until Ctrl-C "
        "(`get events -w` and `get actions -w` follow one kind, as tables).",
    )
    watch.set_defaults(api_handler=_watch)

    _add_config(sub)
    completion.add_command(sub)


def _command(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(name, epilog=EXIT_CODES_HELP, **kwargs)
    return parser


def _resources(sub: Any, verb: str, what: str) -> Any:
    """A verb taking a resource (`create maintenance`), as kubectl's; its subparsers."""
    return _command(sub, verb, help=what).add_subparsers(
        dest="resource", required=True, metavar="RESOURCE"
    )


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
        if hasattr(args, "offline_handler"):
            args.offline_handler(args)
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
            f"{action['status']}{_dry(action)} (supervisor describe action {action['id']})"
        ),
    )


def _dry(action: dict[str, Any]) -> str:
    return " (dry run)" if action.get("dry_run") else ""


# --- watch -----------------------------------------------------------------------------


def _watch(client: Client, args: argparse.Namespace) -> None:
    def opened() -> None:
        print(f"watching {client.server} (Ctrl-C to stop)", file=sys.stderr, flush=True)

    def on_message(message: StreamMessage) -> None:
        if message.kind in ("event", "action"):
            print(_watch_line(message, args.output), flush=True)

    follow.stream(client, opened, on_message, on_resync=lambda: None)


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
        what = f"{data['type']} {data['status']}{_dry(data)}"
        extra = output.text(data.get("error"))
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

"""Fault drills from the command line: `get drills`, `create drill` and `delete drill`.

A drill is a `schedule` fault (POST /api/v1/faults with `schedule`): one fault of its
kinds per run, by a cron expression (UTC) or at a fixed interval, until deleted. Faults
at random (`inject schedule --param schedule=random,120`) are schedules too, and are
listed with them. The server needs fault injection on (`enable_fault_injection`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from resiliency_protocol import faults
from supervisor.ops import output
from supervisor.ops.args import positive_duration
from supervisor.ops.client import Client, api_path
from supervisor.ops.errors import EXIT_CODES_HELP, CliError, ExitCode
from supervisor.ops.listing import show, show_list
from supervisor.ops.output import Column, field

KIND = "drill"
ALIASES = ["drills"]
#: What a drill may inject (the API's own list; a backend may take fewer).
DRILL_KINDS = tuple(kind.value for kind in faults.DRILL_KINDS)


def _schedule(fault: output.Row) -> Any:
    return (fault.get("params") or {}).get("schedule")


def when(fault: output.Row) -> str:
    """When a schedule injects: `cron 0 2 * * *`, `every 1h0m`, `random ~2m0s`."""
    schedule = _schedule(fault)
    if isinstance(schedule, dict):
        if schedule.get("cron") is not None:
            return f"cron {schedule['cron']}"
        return f"every {output.duration(schedule.get('every_s'))}"
    if isinstance(schedule, str):
        kind, _, mean = schedule.partition(",")
        try:
            return f"{kind} ~{output.duration(float(mean))}"
        except ValueError:
            return schedule
    return "-"


def kinds(fault: output.Row) -> str:
    schedule = _schedule(fault)
    if isinstance(schedule, dict):
        return output.text(schedule.get("kinds"))
    if isinstance(schedule, str):
        kind = schedule.partition(",")[0]
        return "any" if kind == "random" else kind
    return "-"


DRILL_COLUMNS = [
    field("ID", "id"),
    field("JOB", "job"),
    Column("WHEN", when),
    Column("KINDS", kinds),
    field("AGE", "created_at", output.age),
    field("CREATED", "created_at", output.when, wide=True),
]


# --- registration ----------------------------------------------------------------------


def add_get(resources: Any, common: argparse.ArgumentParser) -> None:
    command = resources.add_parser(
        "drills",
        aliases=["drill"],
        parents=[common],
        help="Fault drills and random fault schedules running now, newest first.",
    )
    command.add_argument("ids", nargs="*", metavar="ID", type=int, help="Only these drills.")
    command.add_argument("--job", help="Drills of this job.")
    command.set_defaults(api_handler=_get)


def add_create(resources: Any, common: argparse.ArgumentParser) -> None:
    command = resources.add_parser(
        KIND,
        aliases=ALIASES,
        parents=[common],
        epilog=EXIT_CODES_HELP,
        help="Inject faults on a clock (POST /api/v1/faults with a schedule).",
        description="A fault drill: one fault of the given kinds per run, on a live node of "
        "--job (or any job), at the times of --cron (UTC) or every --every, until deleted.",
    )
    clock = command.add_mutually_exclusive_group(required=True)
    clock.add_argument(
        "--cron", help="5 fields, minute hour day month weekday, in UTC: '0 2 * * *'."
    )
    clock.add_argument(
        "--every",
        type=positive_duration,
        help="A fixed interval: seconds or a duration (30m, 1h30m); 1s to 31d.",
    )
    command.add_argument(
        "--kind",
        dest="kinds",
        action="append",
        required=True,
        choices=DRILL_KINDS,
        help="What it may inject, one drawn at random per run; repeat for several.",
    )
    command.add_argument("--job", help="The job whose live nodes it hits (default: any).")
    command.set_defaults(api_handler=_create)


def add_delete(resources: Any, common: argparse.ArgumentParser) -> None:
    command = resources.add_parser(
        KIND,
        aliases=ALIASES,
        parents=[common],
        epilog=EXIT_CODES_HELP,
        help="Stop drills (their stored jobs are removed).",
    )
    command.add_argument("ids", nargs="+", metavar="ID", type=int)
    command.set_defaults(api_handler=_delete)


# --- handlers --------------------------------------------------------------------------


def _get(client: Client, args: argparse.Namespace) -> None:
    faults: list[dict[str, Any]] = client.get(api_path("faults"), {"active": "true"})
    drills = [f for f in faults if f["kind"] == "schedule"]
    if args.ids:
        by_id = {f["id"]: f for f in drills}
        missing = [i for i in args.ids if i not in by_id]
        if missing:
            raise CliError(f"drill {missing[0]} not found (or ended)", ExitCode.NOT_FOUND)
        drills = [by_id[i] for i in dict.fromkeys(args.ids)]
    drills = [f for f in drills if args.job in (None, f["job"])]
    if not drills and args.output in ("table", "wide", "name"):
        print("No drills found.", file=sys.stderr)
        return
    show_list(drills, args, DRILL_COLUMNS, KIND)


def _create(client: Client, args: argparse.Namespace) -> None:
    schedule: dict[str, Any] = {"kinds": args.kinds}
    if args.cron is not None:
        schedule["cron"] = args.cron
    else:
        schedule["every_s"] = args.every
    if args.job is not None:
        schedule["job"] = args.job
    drill = client.post(api_path("faults"), {"schedule": schedule})
    show(drill, args, KIND, lambda: _said(drill, "created"))


def _said(drill: dict[str, Any], what: str) -> str:
    target = f"job {drill['job']}" if drill.get("job") else "any job"
    return f"{KIND}/{drill['id']} {what}: {when(drill)}, {kinds(drill)} on {target}"


def _delete(client: Client, args: argparse.Namespace) -> None:
    ids = list(dict.fromkeys(args.ids))
    ended: list[dict[str, Any]] = []
    failures: list[CliError] = []
    for drill_id in ids:
        try:
            fault = client.get(api_path("faults", drill_id))
            if fault["kind"] != "schedule":
                # Not a drill: `supervisor end` ends other faults.
                raise CliError(
                    f"fault {drill_id} is a {fault['kind']} fault, not a drill "
                    f"(supervisor end {drill_id})",
                    ExitCode.NOT_FOUND,
                )
            ended.append(client.delete(api_path("faults", drill_id)))
        except CliError as exc:
            if len(ids) == 1:
                raise
            failures.append(exc)
            print(f"supervisor delete: {drill_id}: {exc.message}", file=sys.stderr)
    if ended:
        data: Any = ended if len(ids) > 1 else ended[0]
        show(data, args, KIND, lambda: "\n".join(_said(d, "deleted") for d in ended))
    if failures:
        raise CliError(f"{len(failures)} of {len(ids)} drills not deleted", failures[0].code)

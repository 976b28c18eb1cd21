"""`supervisor reset-budget JOB`: start a job's restart budget over (POST
/api/v1/jobs/{name}/reset-budget), after the supervisor gave up on it and the cause was
fixed. Recorded as a `job_budget_reset` event."""

from __future__ import annotations

import argparse
from typing import Any

from supervisor.ops import output
from supervisor.ops.client import Client, api_path


def add_reset_budget(sub: Any, common: argparse.ArgumentParser, epilog: str) -> None:
    command = sub.add_parser(
        "reset-budget",
        parents=[common],
        epilog=epilog,
        help="Start a job's restart budget over: it is healed again (recorded as an event).",
    )
    command.add_argument("job", metavar="JOB")
    command.set_defaults(api_handler=_reset_budget)


def _reset_budget(client: Client, args: argparse.Namespace) -> None:
    reset = client.post(api_path("jobs", args.job, "reset-budget"), {})
    if args.output != "table":
        print(output.dump(reset, args.output), flush=True)
        return
    job, event = reset["job"], reset["event"]
    was = "given up" if event["details"].get("was_given_up") else "not given up"
    print(
        f"job {job['name']}: budget reset (it was {was}), now {job['state']} (event {event['id']})",
        flush=True,
    )

"""`supervisor goodput` and `supervisor advise`: the offline calculators on the command line."""

from __future__ import annotations

import argparse
import json
from typing import Any

from supervisor.goodput.advice import TierInput, advise, ramdisk_sizing
from supervisor.goodput.anchor_log import read_anchor_log
from supervisor.goodput.breakdown import goodput_from_anchor_log
from supervisor.goodput.report import (
    advice_to_dict,
    goodput_to_dict,
    ramdisk_to_dict,
    render_advice_text,
    render_goodput_text,
    render_ramdisk_text,
)


def add_commands(sub: Any) -> None:
    goodput = sub.add_parser(
        "goodput",
        help="Goodput and badput of a job from an event log (the anchor calculator's "
        "JSON-lines format).",
    )
    goodput.add_argument("log", help="JSON-lines file: user_scheduled, job_started, ...")
    goodput.add_argument(
        "--reference-step-time-s", type=float, help="As the anchor calculator's; measured if unset."
    )
    goodput.add_argument("--job", help="Job to report (default: that of the first event).")
    goodput.add_argument("--json", action="store_true", help="Print JSON instead of a table.")

    advise_ = sub.add_parser("advise", help="Checkpoint intervals from measured costs and MTBF.")
    advise_.add_argument("--step-time-s", type=float, required=True)
    advise_.add_argument("--mtbf-s", type=float, required=True, help="Mean time between failures.")
    advise_.add_argument("--local-save-s", type=float, required=True, help="Blocking save time.")
    advise_.add_argument("--local-every", type=int, help="Current local interval, in steps.")
    advise_.add_argument("--durable-save-s", type=float, help="Durable tier blocking save time.")
    advise_.add_argument("--durable-every", type=int, help="Current durable interval, in steps.")
    advise_.add_argument(
        "--durable-mtbf-s", type=float, help="MTBF of failures the local tier cannot survive."
    )
    advise_.add_argument("--parameters", type=float, help="Model parameters, for ramdisk sizing.")
    advise_.add_argument("--hosts", type=int, help="Hosts, for ramdisk sizing.")
    advise_.add_argument("--json", action="store_true", help="Print JSON instead of tables.")


def run(args: argparse.Namespace) -> None:
    """Run `goodput` or `advise`; bad input raises ValueError/OSError with one line."""
    if args.command == "goodput":
        events = read_anchor_log(args.log)
        report = goodput_from_anchor_log(events, args.reference_step_time_s, job_name=args.job)
        print(
            json.dumps(goodput_to_dict(report), indent=2)
            if args.json
            else render_goodput_text(report)
        )
        return
    durable = None
    if args.durable_save_s is not None:
        durable = TierInput("durable", args.durable_save_s, args.durable_every)
    elif args.durable_every is not None:
        raise ValueError("--durable-every needs --durable-save-s")
    advice = advise(
        args.step_time_s,
        TierInput("local", args.local_save_s, args.local_every),
        mtbf_s=args.mtbf_s,
        durable=durable,
        durable_mtbf_s=args.durable_mtbf_s,
    )
    if (args.parameters is None) != (args.hosts is None):
        raise ValueError("--parameters and --hosts go together")
    sizing = ramdisk_sizing(args.parameters, args.hosts) if args.parameters is not None else None
    if args.json:
        out: dict[str, Any] = {"advice": advice_to_dict(advice)}
        if sizing is not None:
            out["ramdisk"] = ramdisk_to_dict(sizing)
        print(json.dumps(out, indent=2))
        return
    print(render_advice_text(advice))
    if sizing is not None:
        print()
        print(render_ramdisk_text(sizing))

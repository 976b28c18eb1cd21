"""`supervisor goodput` and `supervisor advise`: on a running supervisor, or offline.

Online, they ask the supervisor's API (`GET /api/v1/jobs/{job}/goodput`, `/advice`)
through the operator commands' client: server and token from `--server`/`--url` and
`--token`, the environment or a context (see supervisor.ops.config), errors as their
exit codes. `goodput` is online unless given a log file, and without `--job` it lists
every job's; `advise` is online with `--job`. `-o json|yaml` (or `--json`) prints the
API's answer. Offline, `goodput` reads the gpu-recipes goodput calculator's JSON-lines
log and `advise` takes the measurements as flags.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import fields
from datetime import datetime
from typing import Any

from resiliency_protocol.checkpoint_reports import Tier
from supervisor.goodput.advice import (
    CheckpointAdvice,
    TierAdvice,
    TierInput,
    advise,
)
from supervisor.goodput.calculator_log import read_calculator_log
from supervisor.goodput.calculator_timeline import goodput_from_calculator_log
from supervisor.goodput.model import Badput, GoodputReport, TierStats
from supervisor.goodput.ramdisk import RamdiskSizing, ramdisk_sizing
from supervisor.goodput.report import (
    advice_to_dict,
    goodput_to_dict,
    ramdisk_to_dict,
    render_advice_text,
    render_goodput_text,
    render_ramdisk_text,
)
from supervisor.ops import output
from supervisor.ops.client import api_path
from supervisor.ops.commands import connect, connection_options


def _add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", dest="output", action="store_const", const="json", help="As -o json."
    )


def add_commands(sub: Any) -> None:
    # A report is computed from the job's whole history: give it longer than a lookup.
    online = connection_options(url_alias=True, timeout_s=30.0)
    goodput = sub.add_parser(
        "goodput",
        parents=[online],
        help="Goodput and badput of a job, or of every job: live from a supervisor, or "
        "from an event log (the gpu-recipes goodput calculator's JSON-lines format).",
    )
    goodput.add_argument(
        "log", nargs="?", help="JSON-lines file: user_scheduled, job_started, ... (offline)."
    )
    goodput.add_argument(
        "--reference-step-time-s",
        type=float,
        help="As the gpu-recipes calculator's; measured if unset.",
    )
    goodput.add_argument(
        "--job",
        help="Job to report (online default: a summary of every job; offline default: that "
        "of the first event).",
    )
    _add_json(goodput)

    advise_ = sub.add_parser(
        "advise",
        parents=[online],
        help="Checkpoint intervals from measured costs and MTBF: of a job on a running "
        "supervisor (--job), or from flags.",
    )
    advise_.add_argument("--job", help="Job to advise on (online).")
    advise_.add_argument("--step-time-s", type=float, help="Time per step (offline).")
    advise_.add_argument(
        "--mtbf-s", type=float, help="Mean time between failures (online: instead of observed)."
    )
    advise_.add_argument("--local-save-s", type=float, help="Blocking save time (offline).")
    advise_.add_argument("--local-every", type=int, help="Current local interval, in steps.")
    advise_.add_argument("--durable-save-s", type=float, help="Durable tier blocking save time.")
    advise_.add_argument("--durable-every", type=int, help="Current durable interval, in steps.")
    advise_.add_argument(
        "--durable-mtbf-s", type=float, help="MTBF of failures the local tier cannot survive."
    )
    advise_.add_argument("--parameters", type=float, help="Model parameters, for ramdisk sizing.")
    advise_.add_argument(
        "--hosts", type=int, help="Hosts, for ramdisk sizing (online default: the job's nodes)."
    )
    _add_json(advise_)


def run(args: argparse.Namespace) -> None:
    """Run `goodput` or `advise`; bad input raises ValueError/OSError with one line, and
    the online requests CliError (with its exit code)."""
    if args.command == "goodput":
        if args.log is None:
            _goodput_online(args)
            return
        if args.server is not None:
            raise ValueError("give a log file or --server (--url), not both")
        events = read_calculator_log(args.log)
        report = goodput_from_calculator_log(events, args.reference_step_time_s, job_name=args.job)
        _print(goodput_to_dict(report), args, lambda: render_goodput_text(report))
        return
    if args.server is not None and not args.job:
        raise ValueError("--job is required with --server (--url)")
    if args.job:
        _advise_online(args)
        return
    for flag in ("step_time_s", "mtbf_s", "local_save_s"):
        if getattr(args, flag) is None:
            raise ValueError(
                f"--{flag.replace('_', '-')} is required offline (or give --url and --job)"
            )
    durable = None
    if args.durable_save_s is not None:
        durable = TierInput(Tier.DURABLE, args.durable_save_s, args.durable_every)
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
    out: dict[str, Any] = {"advice": advice_to_dict(advice)}
    if sizing is not None:
        out["ramdisk"] = ramdisk_to_dict(sizing)

    def as_text() -> str:
        text = render_advice_text(advice)
        return text if sizing is None else f"{text}\n\n{render_ramdisk_text(sizing)}"

    _print(out, args, as_text)


def _print(data: Any, args: argparse.Namespace, as_text: Callable[[], str]) -> None:
    print(as_text() if args.output == "table" else output.dump(data, args.output))


# --- online --------------------------------------------------------------------------------


def _get(args: argparse.Namespace, what: str, params: dict[str, Any]) -> dict[str, Any]:
    with connect(args) as client:
        data: dict[str, Any] = client.get(api_path("jobs", args.job, what), params)
    return data


def _goodput_online(args: argparse.Namespace) -> None:
    params = {"points": 0, "reference_step_time_s": args.reference_step_time_s}
    if args.job is None:
        _goodput_of_every_job(args, params)
        return
    data = _get(args, "goodput", params)
    if args.output != "table":
        print(output.dump(data, args.output))
        return
    print(render_goodput_text(goodput_from_api(data)))
    s = data.get("sources", {})
    print(
        f"\nfrom {s.get('events', 0)} events, {s.get('actions', 0)} actions, "
        f"{s.get('checkpoint_reports', 0)} checkpoint reports and "
        f"{s.get('progress_samples', 0)} step samples; "
        f"{data['start']} to {data['end']}"
    )


def _advise_online(args: argparse.Namespace) -> None:
    if args.hosts is not None and args.parameters is None:
        raise ValueError("--hosts needs --parameters")
    offline_only = ("step_time_s", "local_save_s", "local_every", "durable_save_s", "durable_every")
    given = [f for f in offline_only if getattr(args, f) is not None]
    if given:
        raise ValueError(
            f"--{given[0].replace('_', '-')} is for offline advice: online, the costs are measured"
        )
    data = _get(
        args,
        "advice",
        {
            "mtbf_s": args.mtbf_s,
            "durable_mtbf_s": args.durable_mtbf_s,
            "parameters": args.parameters,
            "hosts": args.hosts,
        },
    )
    if args.output != "table":
        print(output.dump(data, args.output))
        return
    print(
        f"Job {data['job']}: measured goodput {data['measured_goodput'] * 100:.1f}%; "
        f"{data['observed']['note']}\n"
    )
    print(render_advice_text(advice_from_api(data)))
    if data.get("ramdisk") is not None:
        print()
        print(render_ramdisk_text(ramdisk_from_api(data["ramdisk"])))


GOODPUT_COLUMNS = [
    output.field("JOB", "job"),
    output.field("GOODPUT", "goodput", output.percent),
    output.field("WALL", "wall_s", output.duration),
    output.field("PRODUCTIVE", "productive_s", output.duration),
    output.field("BADPUT", "badput_total_s", output.duration),
    output.field("FAILURES", "failures"),
    output.field("LAST-STEP", "last_step"),
    output.field("STEP-TIME", "step_time_s", output.duration),
]


def _goodput_of_every_job(args: argparse.Namespace, params: dict[str, Any]) -> None:
    with connect(args) as client:
        reports = [
            client.get(api_path("jobs", job["name"], "goodput"), params)
            for job in client.get(api_path("jobs"))
        ]
    if args.output != "table":
        print(output.dump(reports, args.output))
    elif reports:
        print(output.table(reports, GOODPUT_COLUMNS))
    else:
        print("No jobs found.", file=sys.stderr)


def _pick(cls: Any, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def goodput_from_api(data: dict[str, Any]) -> GoodputReport:
    """The API's goodput answer (GoodputOut) as a report, to print it as offline."""
    return GoodputReport(
        job=data["job"],
        start=datetime.fromisoformat(data["start"]).timestamp(),
        end=datetime.fromisoformat(data["end"]).timestamp(),
        wall_s=data["wall_s"],
        productive_s=data["productive_s"],
        badput=Badput(**_pick(Badput, data["badput"])),
        attempts=data["attempts"],
        failures=data["failures"],
        last_step=data["last_step"],
        steps_kept=data["steps_kept"],
        steps_redone=data["steps_redone"],
        step_time_s=data["step_time_s"],
        tiers=tuple(TierStats(**_pick(TierStats, t)) for t in data["tiers"]),
        notes=tuple(data["notes"]),
    )


def advice_from_api(data: dict[str, Any]) -> CheckpointAdvice:
    """The API's advice answer (AdviceOut) as advice, to print it as offline."""
    return CheckpointAdvice(
        step_time_s=data["step_time_s"],
        mtbf_s=data["mtbf_s"],
        durable_mtbf_s=data["durable_mtbf_s"],
        downtime_per_failure_s=data["downtime_per_failure_s"],
        tiers=tuple(TierAdvice(**_pick(TierAdvice, t)) for t in data["tiers"]),
        expected_goodput_current=data["expected_goodput_current"],
        expected_goodput_recommended=data["expected_goodput_recommended"],
        warnings=tuple(data["warnings"]),
        model=data["model"],
    )


def ramdisk_from_api(data: dict[str, Any]) -> RamdiskSizing:
    return RamdiskSizing(**_pick(RamdiskSizing, data))

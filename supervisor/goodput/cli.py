"""`supervisor goodput` and `supervisor advise`: on a running supervisor, or offline.

Online (`--url URL --job J`), they ask the supervisor's API (`GET
/api/v1/jobs/{job}/goodput`, `/advice`) with the operator token (`--token`, or env
`SUPERVISOR_OPERATOR_TOKEN`) and print the same tables as offline; `--json` prints the
API's answer. Offline, `goodput` reads the gpu-recipes goodput calculator's JSON-lines
log and `advise` takes the measurements as flags.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import fields
from datetime import datetime
from typing import Any

import httpx

from supervisor.api.errors import error_message
from supervisor.goodput.advice import (
    CheckpointAdvice,
    RamdiskSizing,
    TierAdvice,
    TierInput,
    advise,
    ramdisk_sizing,
)
from supervisor.goodput.anchor_log import read_anchor_log
from supervisor.goodput.breakdown import goodput_from_anchor_log
from supervisor.goodput.model import Badput, GoodputReport, TierStats
from supervisor.goodput.report import (
    advice_to_dict,
    goodput_to_dict,
    ramdisk_to_dict,
    render_advice_text,
    render_goodput_text,
    render_ramdisk_text,
)

TOKEN_ENV = "SUPERVISOR_OPERATOR_TOKEN"


def _add_online(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="A running supervisor, e.g. http://127.0.0.1:8080.")
    parser.add_argument("--token", help=f"Operator token (default: env {TOKEN_ENV}).")


def add_commands(sub: Any) -> None:
    goodput = sub.add_parser(
        "goodput",
        help="Goodput and badput of a job: live from a supervisor (--url, --job), or from "
        "an event log (the gpu-recipes goodput calculator's JSON-lines format).",
    )
    goodput.add_argument(
        "log", nargs="?", help="JSON-lines file: user_scheduled, job_started, ... (offline)."
    )
    goodput.add_argument(
        "--reference-step-time-s",
        type=float,
        help="As the gpu-recipes calculator's; measured if unset.",
    )
    goodput.add_argument("--job", help="Job to report (offline default: that of the first event).")
    _add_online(goodput)
    goodput.add_argument("--json", action="store_true", help="Print JSON instead of a table.")

    advise_ = sub.add_parser(
        "advise",
        help="Checkpoint intervals from measured costs and MTBF: of a job on a running "
        "supervisor (--url, --job), or from flags.",
    )
    advise_.add_argument("--job", help="Job to advise on (online).")
    _add_online(advise_)
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
    advise_.add_argument("--json", action="store_true", help="Print JSON instead of tables.")


def run(args: argparse.Namespace) -> None:
    """Run `goodput` or `advise`; bad input raises ValueError/OSError with one line."""
    online = args.url is not None
    if online and not args.job:
        raise ValueError("--job is required with --url")
    if args.command == "goodput":
        if online:
            if args.log is not None:
                raise ValueError("give a log file or --url, not both")
            _goodput_online(args)
            return
        if args.log is None:
            raise ValueError("give a log file (offline) or --url and --job (online)")
        events = read_anchor_log(args.log)
        report = goodput_from_anchor_log(events, args.reference_step_time_s, job_name=args.job)
        print(
            json.dumps(goodput_to_dict(report), indent=2)
            if args.json
            else render_goodput_text(report)
        )
        return
    if online:
        _advise_online(args)
        return
    for flag in ("step_time_s", "mtbf_s", "local_save_s"):
        if getattr(args, flag) is None:
            raise ValueError(
                f"--{flag.replace('_', '-')} is required offline (or give --url and --job)"
            )
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


# --- online --------------------------------------------------------------------------------


def _get(args: argparse.Namespace, what: str, params: dict[str, Any]) -> dict[str, Any]:
    token = args.token or os.environ.get(TOKEN_ENV)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = f"{args.url.rstrip('/')}/api/v1/jobs/{args.job}/{what}"
    query = {k: v for k, v in params.items() if v is not None}
    try:
        response = httpx.get(url, params=query, headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise OSError(f"cannot reach {args.url}: {exc}") from None
    if response.status_code != 200:
        raise ValueError(f"{url}: HTTP {response.status_code}: {error_message(response)}")
    data: dict[str, Any] = response.json()
    return data


def _goodput_online(args: argparse.Namespace) -> None:
    data = _get(args, "goodput", {"points": 0, "reference_step_time_s": args.reference_step_time_s})
    if args.json:
        print(json.dumps(data, indent=2))
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
    if args.json:
        print(json.dumps(data, indent=2))
        return
    print(
        f"Job {data['job']}: measured goodput {data['measured_goodput'] * 100:.1f}%; "
        f"{data['observed']['note']}\n"
    )
    print(render_advice_text(advice_from_api(data)))
    if data.get("ramdisk") is not None:
        print()
        print(render_ramdisk_text(ramdisk_from_api(data["ramdisk"])))


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

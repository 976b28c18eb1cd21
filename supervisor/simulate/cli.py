"""`supervisor simulate` and `supervisor export-trace`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from supervisor.simulate.fault_sources import TraceError
from supervisor.simulate.scenario import ScenarioError, load_scenario

# The runner and what it runs (the whole supervisor) are imported by `run`: the other
# subcommands of `supervisor` start without them.

COMMANDS = ("simulate", "export-trace")


def add_commands(sub: Any) -> None:
    sim = sub.add_parser(
        "simulate",
        help="Run the supervisor and its policy on a virtual clock against a simulated "
        "cluster and job; print goodput and badput per run.",
    )
    sim.add_argument("--scenario", type=Path, help="YAML scenario (cluster, job, faults).")
    sim.add_argument("--config", type=Path, help="Supervisor settings file, as for serve.")
    sim.add_argument("--days", type=float, help="Simulated days (overrides the scenario).")
    sim.add_argument("--seed", type=int, help="Seed of the failure mix.")
    sim.add_argument("--trace", type=Path, help="Faults as JSON lines (see export-trace).")
    sim.add_argument(
        "--compare",
        metavar="NAME:SETTING=VALUE[,SETTING=VALUE]",
        action="append",
        default=[],
        help="A run with these settings, beside the others on the same faults; "
        "repeatable (e.g. --compare new:policy=my_policies:Mine).",
    )
    sim.add_argument("-o", "--output", choices=("table", "json"), default="table")
    sim.add_argument("--html", type=Path, help="Also write a chart page to this file.")
    export = sub.add_parser(
        "export-trace",
        help="Write the faults the supervisor recorded as a trace (JSON lines) for simulate.",
    )
    export.add_argument("--config", type=Path, help="Supervisor settings file (database).")
    export.add_argument("--job", help="Only the faults of this job's nodes.")


def _variants(values: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for value in values:
        name, sep, rest = value.partition(":")
        if not sep or not name:
            raise ScenarioError(f"--compare: expected NAME:SETTING=VALUE, got {value!r}")
        settings: dict[str, Any] = {}
        for item in filter(None, rest.split(",")):
            key, eq, raw = item.partition("=")
            if not eq or not key:
                raise ScenarioError(f"--compare {name}: expected SETTING=VALUE, got {item!r}")
            settings[key.strip()] = yaml.safe_load(raw)
        out[name] = settings
    return out


def run(args: argparse.Namespace) -> int:
    from supervisor.controller.loader import PolicyLoadError
    from supervisor.simulate.cluster import SimulatedCluster
    from supervisor.simulate.report import as_html, as_json, as_table, scenario_summary
    from supervisor.simulate.runner import run_variant, scenario_faults

    try:
        if args.command == "export-trace":
            return _export(args)
        scenario = load_scenario(args.scenario, days=args.days, seed=args.seed, trace=args.trace)
        variants = dict(scenario.variants)
        variants.update(_variants(args.compare))
        if not variants:
            variants = {"current": {}}
        nodes = list(SimulatedCluster(scenario, []).nodes)
        faults = scenario_faults(scenario, nodes)
        runs = [
            run_variant(scenario, faults, name, overrides, config=args.config)
            for name, overrides in variants.items()
        ]
    except (ScenarioError, TraceError, PolicyLoadError) as exc:
        print(f"supervisor simulate: {exc}", file=sys.stderr)
        return 2
    if args.output == "json":
        print(json.dumps(as_json(runs, scenario=scenario_summary(scenario)), indent=2))
    else:
        print(
            f"{scenario.days:g} days, {scenario.cluster.nodes} nodes "
            f"({scenario.cluster.num_dp_replicas} x {scenario.cluster.num_nodes_per_dp} + "
            f"{scenario.cluster.spares} spares, {scenario.cluster.gpus_per_node} GPUs each), "
            f"{len(faults)} faults, seed {scenario.seed}"
        )
        print(as_table(runs), end="")
    if args.html is not None:
        args.html.write_text(as_html(runs, title="Simulated goodput by run"))
    return 0


def _export(args: argparse.Namespace) -> int:
    from supervisor.config import load_settings
    from supervisor.simulate.fault_sources import faults_from_events, write_trace
    from supervisor.store import EventFilter, open_store

    settings = load_settings(args.config)
    store = open_store(settings.database_url)
    try:
        events = []
        cursor: str | None = None
        while True:
            page = store.list_events(EventFilter(job=args.job), cursor, limit=1000)
            events += page.items
            cursor = page.next_cursor
            if cursor is None:
                break
    finally:
        store.close()
    sys.stdout.writelines(write_trace(faults_from_events(events), unix_time=True))
    return 0

"""`python -m bench`: run every benchmark and print one table.

The exit code is 0 even when a target is missed: this is a report, read the verdicts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from importlib.metadata import version
from pathlib import Path

from bench import (
    cli_start,
    dashboard,
    detection,
    failover,
    goodput,
    hang_detect,
    ingest,
    memory,
    mttr,
    simulate,
    standby_start,
    stragglers,
)
from bench.chaos_report import chaos_rows
from bench.checkpoint_table import checkpoint_rows, peer_transfer_rows
from bench.fleet_table import fleet_rows
from bench.ingest_table import ingest_rows
from bench.loops import LOOP_NAME
from bench.mttr_table import mttr_rows, torch_mttr_rows
from bench.run_mttr_rows import run_mttr_rows
from bench.table import Row, render, verdict

LATENESS_TARGET_MS = 100.0
MEMORY_SOFT_TARGET_B = 20_000


def detection_rows(configs: list[detection.DetectionConfig]) -> list[Row]:
    rows = []
    for config in configs:
        nodes = config.nodes
        sensor, polling = detection.run(config)
        complete = all(r.detected == r.stopped and r.false_alarms == 0 for r in (sensor, polling))
        missed = "" if complete else f" (missed {sensor.stopped - sensor.detected})"
        rows.append(
            Row(
                f"Detection lateness, {nodes:,} nodes every {config.period_s:g}s p50/p99/max",
                f"{sensor.p50_ms:.0f} / {sensor.p99_ms:.0f} / {sensor.max_ms:.0f} ms{missed}",
                f"polling: {polling.p50_ms:.0f} / {polling.p99_ms:.0f} / {polling.max_ms:.0f} ms",
                f"p99 < {LATENESS_TARGET_MS:.0f} ms",
                verdict(sensor.p99_ms < LATENESS_TARGET_MS and complete),
            )
        )
        rows.append(
            Row(
                "  full GC pauses after the stop (count, max)",
                f"{sensor.gc_full}, {sensor.gc_full_max_ms:.0f} ms",
                f"polling: {polling.gc_full}, {polling.gc_full_max_ms:.0f} ms",
            )
        )
    return rows


def straggler_rows() -> list[Row]:
    rows = []
    for ranks in (8, 64):
        config = stragglers.StragglerConfig(ranks=ranks)
        for factor in (1.2, 1.5):
            times = stragglers.time_to_detect(config, factor)
            found = [t / config.window_s for t in times if t is not None]
            worst = max(found) if len(found) == len(times) else None
            rows.append(
                Row(
                    f"Straggler detection, one rank {factor - 1:.0%} slower among {ranks} "
                    f"({config.jitter:.0%} jitter), worst of {len(times)}",
                    f"{worst:.2f} windows"
                    if worst is not None
                    else f"missed {len(times) - len(found)}",
                    f"straggler_window_s = {config.window_s:g} s (the least by design)",
                    "<= 2 windows",
                    verdict(worst is not None and worst <= 2.0),
                )
            )
    config = stragglers.StragglerConfig(ranks=64)
    false = stragglers.false_reports(config)
    rows.append(
        Row(
            f"  stragglers reported over 60 fault-free windows, 64 ranks ({config.jitter:.0%} "
            "jitter, the whole job 50% slower half-way)",
            str(false),
            "-",
            "0",
            verdict(false == 0),
        )
    )
    return rows


def memory_rows(nodes: int) -> list[Row]:
    mem = memory.run(nodes)
    return [
        Row(
            f"Memory per tracked node ({nodes:,} nodes x 8 workers)",
            f"{mem.bytes_per_node / 1024:.1f} KiB",
            f"heartbeat as JSON: {mem.json_bytes} B ({mem.bytes_per_node / mem.json_bytes:.1f}x)",
            f"< {MEMORY_SOFT_TARGET_B // 1000} KB (soft)",
            verdict(mem.bytes_per_node < MEMORY_SOFT_TARGET_B),
        )
    ]


def machine_line() -> str:
    load = os.getloadavg()[0]
    return (
        f"machine: {os.cpu_count()} cores, {platform.python_implementation()} "
        f"{platform.python_version()}, {LOOP_NAME}, uvicorn {version('uvicorn')}, "
        f"fastapi {version('fastapi')}, pydantic {version('pydantic')}, "
        f"load avg {load:.2f} at start"
    )


def goodput_rows(hours: float = 24.0) -> list[Row]:
    """The goodput endpoint's work on a day of history; 32 ranks against 4 shows how it
    grows with the ranks' checkpoint reports (summarised in SQL, so it should not)."""
    small_n, small = goodput.run(hours, 4)
    big_n, big = goodput.run(hours, 32)
    return [
        Row(
            f"Goodput of {hours:g} h of history, 32 ranks ({big_n:,} checkpoint reports)",
            f"{big['total']:.2f} s (read {big['read']:.2f}, timeline {big['timeline']:.2f}, "
            f"goodput + series {big['series']:.2f})",
            f"4 ranks ({small_n:,} reports): {small['total']:.2f} s",
            "< 2 s",
            verdict(big["total"] < 2.0),
        )
    ]


def simulate_rows() -> list[Row]:
    """Simulated seconds per wall second at three sizes; the 2,048-node, 54-day run
    against its target, beside the same cluster with no faults (the floor)."""
    rows = []
    for nodes, days in ((256, 54.0), (2_048, 54.0), (16_384, 7.0)):
        r = simulate.run(nodes, days)
        target, ok = "-", None
        if nodes == 2_048:
            target, ok = "< 60 s for 54 days", r.faulty.wall_s < 60.0
        rows.append(
            Row(
                f"Simulate {r.nodes:,} nodes x {days:g} days, {r.faulty.faults} faults "
                f"(default policy)",
                f"{r.rate:,.0f} sim-s per wall-s ({r.faulty.wall_s:.1f} s; goodput "
                f"{r.faulty.goodput.goodput * 100:.2f}%)",
                f"no faults: {r.quiet_rate:,.0f} sim-s per wall-s ({r.quiet.wall_s:.1f} s)",
                target,
                "info" if ok is None else verdict(ok),
            )
        )
    return rows


SECTIONS = (
    "simulate",
    "ingest",
    "ingest-fleet",  # nodes beating at a fleet's rate, late at random; SQLite and PostgreSQL
    "detection",
    "stragglers",
    "memory",
    "goodput",
    "mttr",
    "mttr-torch",
    "mttr-run",  # part of "mttr-torch": `supervisor run` 2x2 against torchrun 2x2
    "failover",
    "checkpoint",
    "checkpoint-peer",
    "checkpoint-s3",
    "chaos",
    "dashboard",
    "cli",
    "hang-run",  # a frozen rank of an unchanged script, of an instrumented one, torchrun's
    "standby-start",  # a rank started again on its node: forked by its standby, or anew
)
#: Run only when named with --only: a real Kubernetes control plane (2,000 kwok nodes; a
#: PyTorch JobSet crashed and healed again and again).
ASKED_ONLY = ("kube-scale", "kube-heal")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "--only",
        choices=(*SECTIONS, *ASKED_ONLY),
        action="append",
        default=None,
    )
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument(
        "--duration", type=float, default=2.0, help="ingest: measured window, seconds"
    )
    parser.add_argument(
        "--rounds", type=int, default=15, help="ingest: rounds (one window per app each)"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="ingest: save cProfile stats of each server here; ingest-fleet: py-spy's"
        " samples of the supervisor in each window (bench/profile_top.py reads them)",
    )
    parser.add_argument(
        "--fleet-window", type=float, default=15.0, help="ingest-fleet: measured window, s"
    )
    parser.add_argument(
        "--quick", action="store_true", help="ingest-fleet: SQLite, 8,000-rank jobs only"
    )
    parser.add_argument("--faults", type=int, default=5, help="mttr: faults per kind and policy")
    parser.add_argument(
        "--mttr-keep", type=Path, default=None, help="mttr: keep the clusters' run dirs here"
    )
    parser.add_argument(
        "--minutes", type=float, default=2.0, help="chaos: minutes of random faults"
    )
    parser.add_argument(
        "--nodes", type=int, default=2_000, help="kube-scale: kwok nodes (and pods of the JobSet)"
    )
    args = parser.parse_args(argv)
    only = set(args.only or SECTIONS)
    header = machine_line()
    started = time.monotonic()
    rows: list[Row] = []
    if "ingest" in only:
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
        config = ingest.IngestConfig(
            connections=args.connections,
            duration_s=args.duration,
            rounds=args.rounds,
            profile_dir=args.profile.resolve() if args.profile else None,
        )
        rows += ingest_rows(config)
        # The largest fleets: 25,000 nodes of 8 GPUs, heartbeating every 5 s.
        rows += ingest_rows(dataclasses.replace(config, nodes=25_000), period_s=5.0)
    if "ingest-fleet" in only:
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
        profile = args.profile.resolve() if args.profile else None
        rows += fleet_rows(args.quick, args.fleet_window, profile)
    if "detection" in only:
        rows += detection_rows(
            [
                detection.DetectionConfig(nodes=1_000),
                detection.DetectionConfig(nodes=10_000),
                # The largest fleets: 25,000 nodes of 8 GPUs, heartbeating every 5 s.
                detection.DetectionConfig(nodes=25_000, period_s=5.0, timeout_s=15.0),
            ]
        )
    if "stragglers" in only:
        rows += straggler_rows()
    if "memory" in only:
        rows += memory_rows(10_000) + memory_rows(25_000)
    if "goodput" in only:
        rows += goodput_rows()
    if "mttr" in only:
        keep = args.mttr_keep.resolve() if args.mttr_keep else None
        rows += mttr_rows(mttr.MttrConfig(faults_per_kind=args.faults, keep_dir=keep))
    if "mttr-torch" in only:
        keep = args.mttr_keep.resolve() if args.mttr_keep else None
        rows += torch_mttr_rows(args.faults, keep)
    if only & {"mttr-torch", "mttr-run"}:
        keep = args.mttr_keep.resolve() if args.mttr_keep else None
        rows += run_mttr_rows(args.faults, keep)
    if "failover" in only:
        rows += failover.rows()
    if "checkpoint" in only:
        rows += checkpoint_rows()
    elif "checkpoint-peer" in only:  # part of "checkpoint"; alone, it takes a minute
        rows += peer_transfer_rows()
    if "checkpoint-s3" in only:
        from bench import checkpoint_s3  # torch and obstore: imported only when it runs

        rows += checkpoint_s3.rows()
    if "chaos" in only:
        rows += chaos_rows(args.minutes)
    if "simulate" in only:
        rows += simulate_rows()
    if "dashboard" in only:
        rows += dashboard.rows()
    if "cli" in only:
        rows += cli_start.rows()
    if "hang-run" in only:
        rows += hang_detect.rows()
    if "standby-start" in only:
        rows += standby_start.rows()
    if "kube-scale" in only:
        from bench import kube_scale  # starts the tests' control plane: only when asked

        rows += kube_scale.rows(args.nodes)
    if "kube-heal" in only:
        from bench import kube_heal  # starts the tests' control plane: only when asked

        rows += kube_heal.rows()
    print(render(rows))
    print(f"{header}; took {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m bench`: run every benchmark and print one table.

The exit code is 0 even when a target is missed: this is a report, read the verdicts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

from bench import (
    detection,
    failover,
    goodput,
    ingest,
    memory,
    mttr,
    simulate,
    stragglers,
    torchrun_mttr,
)
from bench.chaos_report import chaos_rows
from bench.loops import LOOP_NAME
from bench.table import Row, render, verdict

INGEST_TARGET_PCT = 60.0
LATENESS_TARGET_MS = 100.0
MEMORY_SOFT_TARGET_B = 20_000


def ingest_rows(config: ingest.IngestConfig) -> list[Row]:
    cmp = ingest.run(config)
    sup, bare = cmp.supervisor, cmp.bare
    ratios = sorted(cmp.ratios)
    clean = sup.events_rows == 0 and sup.db_changed is False
    errors = sup.errors + bare.errors
    conns = f"{config.connections} conns, {config.nodes} nodes, {config.rounds} rounds"
    return [
        Row(
            f"Heartbeat ingest, HTTP ({conns})",
            f"{sup.rps:,.0f} req/s = {cmp.pct:.1f}% of ceiling (median of rounds)",
            f"bare ASGI app: {bare.rps:,.0f} req/s",
            f">= {INGEST_TARGET_PCT:.0f}% of ceiling",
            verdict(cmp.pct >= INGEST_TARGET_PCT and errors == 0),
        ),
        Row(
            "  per-round ratio min / max",
            f"{100 * ratios[0]:.1f}% / {100 * ratios[-1]:.1f}%" if ratios else "-",
        ),
        Row(
            "  server CPU per request (user + system)",
            f"{sup.cpu_us_per_request:.1f} us = {cmp.cpu_pct:.1f}% of ceiling",
            f"{bare.cpu_us_per_request:.1f} us",
        ),
        Row(
            "  latency p50 / p99",
            f"{sup.p50_ms:.2f} / {sup.p99_ms:.2f} ms",
            f"{bare.p50_ms:.2f} / {bare.p99_ms:.2f} ms",
        ),
        Row(
            "  CPU during window: server / client",
            f"{sup.server_cpu_pct:.0f}% / {sup.client_cpu_pct:.0f}%",
            f"{bare.server_cpu_pct:.0f}% / {bare.client_cpu_pct:.0f}%",
        ),
        Row(
            "  SQL writes during windows",
            f"{sup.events_rows} event rows, db {'CHANGED' if sup.db_changed else 'unchanged'}"
            f" over {sup.requests:,} heartbeats",
            f"{sup.nodes_rows} node rows written at registration",
            "0 writes",
            verdict(clean),
        ),
    ] + (
        [Row("  request errors", f"{sup.errors} / {bare.errors}", verdict="FAIL")] if errors else []
    )


def detection_rows(node_counts: list[int]) -> list[Row]:
    rows = []
    for nodes in node_counts:
        sensor, polling = detection.run(detection.DetectionConfig(nodes=nodes))
        complete = all(r.detected == r.stopped and r.false_alarms == 0 for r in (sensor, polling))
        missed = "" if complete else f" (missed {sensor.stopped - sensor.detected})"
        rows.append(
            Row(
                f"Detection lateness, {nodes:,} nodes p50/p99/max",
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


def mttr_rows(config: mttr.MttrConfig) -> list[Row]:
    ours, base = mttr.run(config)
    n = config.faults_per_kind
    target = config.target_s
    rows = []
    for kind in config.kinds:
        mine, theirs = ours.of(kind), base.of(kind)
        good = [f for f in mine if f.ok]
        complete = len(good) == n
        mttrs = [f.mttr_s for f in good if f.mttr_s is not None]
        lost = [f.steps_lost for f in good if f.steps_lost is not None]
        rows += [
            Row(
                f"MTTR {kind} (n={n}) p50/max",
                mttr.fmt_s(mttrs) + mttr.failed_note(mine, n),
                "periodic only: "
                + mttr.fmt_s([f.mttr_s for f in theirs if f.ok and f.mttr_s is not None])
                + mttr.failed_note(theirs, n),
                f"< {target:g} s (timeout + 5 s)",
                verdict(complete and bool(mttrs) and max(mttrs) < target),
            ),
            Row(
                f"Steps lost per fault {kind} mean/max",
                mttr.lost_summary(mine) + mttr.failed_note(mine, n),
                f"periodic only: {mttr.lost_summary(theirs)}" + mttr.failed_note(theirs, n),
                "<= 1",
                verdict(complete and bool(lost) and max(lost) <= 1),
            ),
            Row(
                f"  detection {kind} p50/max",
                mttr.fmt_s([f.detection_s for f in mine if f.detection_s is not None]),
                "periodic only: "
                + mttr.fmt_s([f.detection_s for f in theirs if f.detection_s is not None]),
            ),
        ]
    for run in (ours, base):
        who = "default" if run is ours else "periodic only"
        rows += [
            Row(f"  {who}: {f.kind} on {f.victim} failed", f.error or "", verdict="FAIL")
            for f in run.faults
            if not f.ok
        ]
        if run.error is not None:
            rows.append(Row(f"  {who}: run stopped early", run.error, verdict="FAIL"))
    return rows


# The torch workload of the MTTR rows: small enough for four ranks' worth of processes on
# two cores, one log line per step (progress is read from them).
TORCH_MTTR_ENV = (
    ("D_MODEL", "64"),
    ("N_LAYERS", "2"),
    ("N_HEADS", "4"),
    ("SEQ_LEN", "32"),
    ("LOG_EVERY_STEPS", "1"),
    ("OMP_NUM_THREADS", "1"),
)
TORCH_KINDS = ("node_down", "worker_crash", "worker_hang")
IN_PROCESS_KINDS = ("node_down", "worker_crash")


def _recovered(faults: list[mttr.FaultResult]) -> list[mttr.FaultResult]:
    return [f for f in faults if f.ok and f.mttr_s is not None]


def _column(faults: list[mttr.FaultResult], n: int) -> str:
    """detected k/n, detection p50, MTTR p50/max, steps lost mean/max, not recovered."""
    detected = [f.detection_s for f in faults if f.detection_s is not None]
    good = _recovered(faults)
    lost = [f.steps_lost for f in good if f.steps_lost is not None]
    lost_text = f"{sum(lost) / len(lost):.1f} / {max(lost)}" if lost else "-"
    mttrs = [f.mttr_s for f in good if f.mttr_s is not None]
    return (
        f"detected {len(detected)}/{n} in {mttr.fmt_s(detected)}; MTTR {mttr.fmt_s(mttrs)}; "
        f"steps lost {lost_text}; not recovered {n - len(good)}"
    )


def torch_mttr_rows(faults_per_kind: int, keep: Path | None) -> list[Row]:
    """The torch workload under the supervisor (default policy), beside the same faults
    with periodic checkpoints only and beside torchrun's own elastic restart."""
    config = mttr.MttrConfig(
        faults_per_kind=faults_per_kind,
        kinds=TORCH_KINDS,
        replicas=2,
        nodes_per_dp=1,
        spares=2,
        workload="torch",
        workload_env=TORCH_MTTR_ENV,
        keep_dir=keep,
        policy_budget_s=300.0,
        # A repaired node needs a few seconds to be a warm spare again (its standby
        # imports torch): faults come no faster than that, as on a real cluster.
        settle_steps=(40, 60),
    )
    ours, periodic = mttr.run(config)
    full = mttr.run_one(
        mttr.DEFAULT_POLICY,
        dataclasses.replace(config, in_process=False, kinds=IN_PROCESS_KINDS),
        "full-restart",
    )
    torchrun = torchrun_mttr.run(
        torchrun_mttr.TorchrunConfig(
            faults_per_kind=faults_per_kind,
            kinds=TORCH_KINDS,
            step_time_s=config.step_time_s,
            node_repair_s=config.node_repair_s,
            workload_env=TORCH_MTTR_ENV,
            keep_dir=keep,
        )
    )
    n = faults_per_kind
    rows: list[Row] = []
    torchrun_crash = [f.mttr_s for f in _recovered(torchrun.of("worker_crash")) if f.mttr_s]
    for kind in TORCH_KINDS:
        mine = ours.of(kind)
        good = _recovered(mine)
        lost = [f.steps_lost for f in good if f.steps_lost is not None]
        detected = [f for f in mine if f.detection_s is not None]
        mttrs = [f.mttr_s for f in good if f.mttr_s is not None]
        ok = len(good) == n and bool(lost) and max(lost) <= 1 and len(detected) == n
        target = "all recovered and detected, lost <= 1"
        if kind == "worker_crash":
            target += ", MTTR p50 < torchrun's"
            ok = ok and bool(torchrun_crash) and mttr.median(mttrs) < mttr.median(torchrun_crash)
        rows += [
            Row(
                f"torch MTTR {kind} (n={n}): supervisor",
                _column(mine, n),
                "periodic only: " + _column(periodic.of(kind), n),
                target,
                verdict(ok),
            ),
            Row(f"  torch {kind}: torchrun --max-restarts", "", _column(torchrun.of(kind), n)),
        ]
        if kind in IN_PROCESS_KINDS:
            restarted = [f.mttr_s for f in _recovered(full.of(kind)) if f.mttr_s is not None]
            half = bool(mttrs) and bool(restarted)
            half = half and mttr.median(mttrs) <= mttr.median(restarted) / 2
            rows.append(
                Row(
                    f"  torch {kind}: in-process p50 vs full restart",
                    f"in-process {mttr.fmt_s(mttrs)}",
                    "full restart (every rank a new process): " + _column(full.of(kind), n),
                    "<= half of the full restart's",
                    verdict(half),
                )
            )
    runs = (("supervisor", ours), ("periodic only", periodic), ("full restart", full))
    for who, run in (*runs, ("torchrun", torchrun)):
        rows += [
            Row(f"  torch {who}: {f.kind} on {f.victim}", f.error or "", verdict="info")
            for f in run.faults
            if not f.ok
        ]
        if run.error is not None:
            rows.append(Row(f"  torch {who}: run stopped early", run.error, verdict="FAIL"))
    if torchrun.restarts_by_bench:
        rows.append(
            Row(
                "  torchrun: whole-job restarts by the bench",
                f"{torchrun.restarts_by_bench} (the job was lost or its rendezvous kept failing)",
            )
        )
    return rows + hsdp_mttr_rows(faults_per_kind, keep)


def hsdp_mttr_rows(faults_per_kind: int, keep: Path | None) -> list[Row]:
    """The torch workload sharded with HSDP (2 replica groups x 2 shards, FSDP2) under the
    supervisor: a lost node's shard is still in the other replica group, so the survivors'
    emergency checkpoint holds the whole step."""
    config = mttr.MttrConfig(
        faults_per_kind=faults_per_kind,
        kinds=IN_PROCESS_KINDS,
        replicas=4,
        nodes_per_dp=1,
        spares=2,
        workload="torch",
        workload_env=(
            *TORCH_MTTR_ENV,
            ("PARALLELISM", "hsdp"),
            # A rank left waiting in another mesh group's collective fails after this.
            ("COLLECTIVE_TIMEOUT_S", "8"),
        ),
        # Four ranks and six host monitors on two cores: room for the in-process join.
        supervisor_env=(("SUPERVISOR_IN_PROCESS_RESTART_TIMEOUT_S", "60"),),
        keep_dir=keep,
        policy_budget_s=300.0,
        settle_steps=(40, 60),
    )
    run = mttr.run_one(mttr.DEFAULT_POLICY, config, "hsdp")
    n = faults_per_kind
    rows: list[Row] = []
    for kind in IN_PROCESS_KINDS:
        mine = run.of(kind)
        good = _recovered(mine)
        lost = [f.steps_lost for f in good if f.steps_lost is not None]
        most = 0 if kind == "node_down" else 1  # a crashed rank's own copy is older
        ok = len(good) == n and bool(lost) and max(lost) <= most
        rows.append(
            Row(
                f"torch HSDP 2x2 MTTR {kind} (n={n}): supervisor",
                _column(mine, n),
                "DDP rows above",
                f"all recovered, lost <= {most}",
                verdict(ok),
            )
        )
    rows += [
        Row(f"  torch hsdp: {f.kind} on {f.victim}", f.error or "", verdict="info")
        for f in run.faults
        if not f.ok
    ]
    if run.error is not None:
        rows.append(Row("  torch hsdp: run stopped early", run.error, verdict="FAIL"))
    return rows


CHECKPOINT_TIER_TARGET = 0.70
CHECKPOINT_BLOCKING_TARGET = 0.10


def checkpoint_rows() -> list[Row]:
    # torch is the `torch` extra: imported only when this part runs.
    from bench import checkpoint

    res = checkpoint.run(checkpoint.CheckpointConfig())
    gb = res.state_bytes / 1e9
    rows = [
        Row(
            f"Checkpoint, {res.params / 1e6:.0f}M params + Adam ({gb:.2f} GB), 1 rank: "
            "blocking per async save (median)",
            f"{statistics.median(res.blocking_s):.3f} s "
            f"= {statistics.median(res.blocking_s) / res.sync_dcp_save_s:.1%} of sync DCP",
            f"sync DCP save {res.sync_dcp_save_s:.2f} s; sync torch.save "
            f"{res.sync_torch_save_s:.2f} s",
            f"<= {CHECKPOINT_BLOCKING_TARGET:.0%} of sync DCP",
            verdict(
                statistics.median(res.blocking_s)
                <= CHECKPOINT_BLOCKING_TARGET * res.sync_dcp_save_s
            ),
        )
    ]
    for key, raw_key in (
        ("ram save", "ram write"),
        ("ram load", "ram read"),
        ("durable save", "durable write"),
        ("durable load", "durable read"),
    ):
        mine, raw = res.tier[key], res.raw[raw_key]
        rows.append(
            Row(
                f"  {key} (MiB/s)",
                f"{mine:,.0f} MiB/s = {mine / raw:.0%} of raw",
                f"raw {raw_key}: {raw:,.0f} MiB/s",
                f">= {CHECKPOINT_TIER_TARGET:.0%} of raw",
                verdict(mine >= CHECKPOINT_TIER_TARGET * raw),
            )
        )
    rows.append(
        Row(
            "  ram save, with the copy to host memory before it (MiB/s)",
            f"{res.tier['ram save with staging']:,.0f}",
        )
    )
    durable_load = res.tier["durable load"]
    if res.peer_load is not None and res.peer_push is not None:
        rows += [
            Row(
                "  swapped-in spare: restore from the partner's copy (MiB/s)",
                f"{res.peer_load:,.0f} MiB/s = {res.peer_load / durable_load:.1f}x durable",
                f"restore from durable: {durable_load:,.0f} MiB/s",
                "faster than durable",
                verdict(res.peer_load > durable_load),
            ),
            Row("  peer copy, host monitor to host monitor (MiB/s)", f"{res.peer_push:,.0f}"),
        ]
    else:
        rows.append(Row("  peer restore", res.peer_error or "not measured", verdict="FAIL"))
    return rows + sharded_checkpoint_rows()


RESHARDED_RESTORE_TARGET = 1.5


def sharded_checkpoint_rows() -> list[Row]:
    from bench import sharded_checkpoint

    cfg = sharded_checkpoint.ShardedConfig()
    res = sharded_checkpoint.run(cfg)
    gb = res.state_bytes / 1e9
    blocking = statistics.median(res.blocking_s)
    ratio = res.resharded_restore_s / res.same_layout_restore_s
    return [
        Row(
            f"Checkpoint, FSDP2 {cfg.world} ranks, {res.params / 1e6:.0f}M params + Adam "
            f"({gb:.2f} GB): blocking per async save (median, slowest rank)",
            f"{blocking:.3f} s = {blocking / res.sync_dcp_save_s:.1%} of sync DCP",
            f"sync collective DCP save {res.sync_dcp_save_s:.2f} s",
            f"<= {CHECKPOINT_BLOCKING_TARGET:.0%} of sync DCP",
            verdict(blocking <= CHECKPOINT_BLOCKING_TARGET * res.sync_dcp_save_s),
        ),
        Row(
            "  step time with a RAM save every step (FSDP without replicas: 1 step lost)",
            f"{res.step_with_ram_save_s:.3f} s = "
            f"{res.step_with_ram_save_s / res.step_s - 1:+.0%} per step",
            f"without checkpoints {res.step_s:.3f} s",
        ),
        Row("  ram save, summed over ranks (MiB/s)", f"{res.save_mib_s['ram']:,.0f}"),
        Row("  durable save, summed over ranks (MiB/s)", f"{res.save_mib_s['durable']:,.0f}"),
        Row("  ram load, same layout (MiB/s)", f"{res.ram_load_mib_s:,.0f}"),
        Row("  durable load, same layout (MiB/s)", f"{res.durable_load_mib_s:,.0f}"),
        Row(
            f"  restore resharded {cfg.world} -> {cfg.resharded_world} ranks (durable)",
            f"{res.resharded_restore_s:.2f} s = {ratio:.2f}x same layout",
            f"same-layout restore from durable {res.same_layout_restore_s:.2f} s",
            f"<= {RESHARDED_RESTORE_TARGET:g}x",
            verdict(ratio <= RESHARDED_RESTORE_TARGET and res.resharded_tier == "durable"),
        ),
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
    "detection",
    "stragglers",
    "memory",
    "goodput",
    "mttr",
    "mttr-torch",
    "failover",
    "checkpoint",
    "chaos",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "--only",
        choices=SECTIONS,
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
        "--profile", type=Path, default=None, help="save cProfile stats of each server here"
    )
    parser.add_argument("--faults", type=int, default=5, help="mttr: faults per kind and policy")
    parser.add_argument(
        "--mttr-keep", type=Path, default=None, help="mttr: keep the clusters' run dirs here"
    )
    parser.add_argument(
        "--minutes", type=float, default=2.0, help="chaos: minutes of random faults"
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
    if "detection" in only:
        rows += detection_rows([1_000, 10_000])
    if "stragglers" in only:
        rows += straggler_rows()
    if "memory" in only:
        rows += memory_rows(10_000)
    if "goodput" in only:
        rows += goodput_rows()
    if "mttr" in only:
        keep = args.mttr_keep.resolve() if args.mttr_keep else None
        rows += mttr_rows(mttr.MttrConfig(faults_per_kind=args.faults, keep_dir=keep))
    if "mttr-torch" in only:
        keep = args.mttr_keep.resolve() if args.mttr_keep else None
        rows += torch_mttr_rows(args.faults, keep)
    if "failover" in only:
        rows += failover.rows()
    if "checkpoint" in only:
        rows += checkpoint_rows()
    if "chaos" in only:
        rows += chaos_rows(args.minutes)
    if "simulate" in only:
        rows += simulate_rows()
    print(render(rows))
    print(f"{header}; took {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

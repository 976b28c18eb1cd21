"""The MTTR rows of `python -m bench`: the NumPy job under both policies, and the torch
job under the supervisor beside periodic checkpoints only, a full restart and torchrun."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from bench import mttr, mttr_summary, torchrun_mttr
from bench.table import Row, verdict
from resiliency_protocol.faults import FaultKind


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
                mttr_summary.fmt_s(mttrs) + mttr_summary.failed_note(mine, n),
                "periodic only: "
                + mttr_summary.fmt_s([f.mttr_s for f in theirs if f.ok and f.mttr_s is not None])
                + mttr_summary.failed_note(theirs, n),
                f"< {target:g} s (timeout + 5 s)",
                verdict(complete and bool(mttrs) and max(mttrs) < target),
            ),
            Row(
                f"Steps lost per fault {kind} mean/max",
                mttr_summary.lost_summary(mine) + mttr_summary.failed_note(mine, n),
                f"periodic only: {mttr_summary.lost_summary(theirs)}"
                + mttr_summary.failed_note(theirs, n),
                "<= 1",
                verdict(complete and bool(lost) and max(lost) <= 1),
            ),
            Row(
                f"  detection {kind} p50/max",
                mttr_summary.fmt_s([f.detection_s for f in mine if f.detection_s is not None]),
                "periodic only: "
                + mttr_summary.fmt_s([f.detection_s for f in theirs if f.detection_s is not None]),
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


IN_PROCESS_KINDS = (FaultKind.NODE_DOWN, FaultKind.WORKER_CRASH)


def torch_mttr_rows(faults_per_kind: int, keep: Path | None) -> list[Row]:
    """The torch workload under the supervisor (default policy), beside the same faults
    with periodic checkpoints only and beside torchrun's own elastic restart."""
    config = mttr.MttrConfig(
        faults_per_kind=faults_per_kind,
        kinds=torchrun_mttr.TORCH_KINDS,
        replicas=2,
        nodes_per_dp=1,
        spares=2,
        workload="torch",
        workload_env=torchrun_mttr.TORCH_MTTR_ENV,
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
            kinds=torchrun_mttr.TORCH_KINDS,
            step_time_s=config.step_time_s,
            node_repair_s=config.node_repair_s,
            workload_env=torchrun_mttr.TORCH_MTTR_ENV,
            keep_dir=keep,
        )
    )
    n = faults_per_kind
    rows: list[Row] = []
    torchrun_crash = [
        f.mttr_s for f in mttr_summary.recovered(torchrun.of(FaultKind.WORKER_CRASH)) if f.mttr_s
    ]
    for kind in torchrun_mttr.TORCH_KINDS:
        mine = ours.of(kind)
        good = mttr_summary.recovered(mine)
        lost = [f.steps_lost for f in good if f.steps_lost is not None]
        detected = [f for f in mine if f.detection_s is not None]
        mttrs = [f.mttr_s for f in good if f.mttr_s is not None]
        ok = len(good) == n and bool(lost) and max(lost) <= 1 and len(detected) == n
        target = "all recovered and detected, lost <= 1"
        if kind == FaultKind.WORKER_CRASH:
            target += ", MTTR p50 < torchrun's"
            ok = (
                ok
                and bool(torchrun_crash)
                and mttr_summary.median(mttrs) < mttr_summary.median(torchrun_crash)
            )
        rows += [
            Row(
                f"torch MTTR {kind} (n={n}): supervisor",
                mttr_summary.column(mine, n),
                "periodic only: " + mttr_summary.column(periodic.of(kind), n),
                target,
                verdict(ok),
            ),
            Row(
                f"  torch {kind}: torchrun --max-restarts",
                "",
                mttr_summary.column(torchrun.of(kind), n),
            ),
        ]
        if kind in IN_PROCESS_KINDS:
            restarted = [
                f.mttr_s for f in mttr_summary.recovered(full.of(kind)) if f.mttr_s is not None
            ]
            half = bool(mttrs) and bool(restarted)
            half = half and mttr_summary.median(mttrs) <= mttr_summary.median(restarted) / 2
            rows.append(
                Row(
                    f"  torch {kind}: in-process p50 vs full restart",
                    f"in-process {mttr_summary.fmt_s(mttrs)}",
                    "full restart (every rank a new process): "
                    + mttr_summary.column(full.of(kind), n),
                    "<= half of the full restart's",
                    verdict(half),
                )
            )
    runs = (("supervisor", ours), ("periodic only", periodic), ("full restart", full))
    rows += mttr_summary.failure_rows((*runs, ("torchrun", torchrun)))
    rows += mttr_summary.bench_restart_rows("torchrun", torchrun)
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
            *torchrun_mttr.TORCH_MTTR_ENV,
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
        good = mttr_summary.recovered(mine)
        lost = [f.steps_lost for f in good if f.steps_lost is not None]
        most = 0 if kind == FaultKind.NODE_DOWN else 1  # a crashed rank's own copy is older
        ok = len(good) == n and bool(lost) and max(lost) <= most
        rows.append(
            Row(
                f"torch HSDP 2x2 MTTR {kind} (n={n}): supervisor",
                mttr_summary.column(mine, n),
                "DDP rows above",
                f"all recovered, lost <= {most}",
                verdict(ok),
            )
        )
    return rows + mttr_summary.failure_rows((("hsdp", run),))

"""The torch MTTR rows of a job launched as a user launches it: `supervisor run --nnodes 2
--nproc-per-node 2 -m training.torch_workload` (2 nodes x 2 workers, the command run with
torchrun's environment, every rank restarted on a fault) beside `torchrun --nnodes 2
--nproc-per-node 2 -m training.torch_workload` restarting the same script by itself, the
same faults on each, in the same run.

The supervised job's cluster is the one `supervisor run` starts: its `DemoOptions` come
from `supervisor.run_cli.options` given the command line below, and `bench.mttr` runs the
faults on it (the job's own settings, as a user's shell would give them, in
`workload_env`)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from bench import mttr, mttr_summary, torchrun_mttr
from bench.table import Row, verdict
from supervisor import run_cli
from supervisor.local.demo_options import DemoOptions

NNODES = 2
NPROC_PER_NODE = 2
#: A node_down needs a node to take the lost one's place: without a spare `supervisor run`
#: ends the run (torchrun's node is back `node_repair_s` later, as the spare is).
SPARES = 2
#: As the other MTTR rows (torchrun has no heartbeat to time out).
HEARTBEAT_TIMEOUT_S = 1.0
RUN_ARGV = (
    *("--nnodes", str(NNODES), "--nproc-per-node", str(NPROC_PER_NODE)),
    *("--spares", str(SPARES), "--heartbeat-timeout-s", f"{HEARTBEAT_TIMEOUT_S:g}"),
    *("-m", "training.torch_workload"),
)


def run_options(argv: tuple[str, ...] = RUN_ARGV) -> DemoOptions:
    """The local cluster `supervisor run ARGV` starts."""
    parser = argparse.ArgumentParser(prog="supervisor")
    run_cli.add_commands(parser.add_subparsers(dest="command", required=True))
    return run_cli.options(parser.parse_args(["run", *argv]))


def job_env(step_time_s: float) -> tuple[tuple[str, str], ...]:
    """The training job's settings: the model and checkpoint frequencies of every torch
    MTTR row, and of the torchrun run beside it."""
    c = torchrun_mttr.TorchrunConfig()
    return (
        *torchrun_mttr.TORCH_MTTR_ENV,
        ("TOTAL_STEPS", "10000000"),
        ("STEP_TIME_S", f"{step_time_s:g}"),
        ("IN_MEMORY_CHECKPOINTING_FREQ", str(c.in_memory_checkpointing_freq)),
        ("S3_CHECKPOINTING_FREQ", str(c.s3_checkpointing_freq)),
    )


def mttr_config(opts: DemoOptions, faults_per_kind: int, keep: Path | None) -> mttr.MttrConfig:
    """The MTTR run of `opts` (from `run_options`): its cluster, command and settings."""
    if opts.command is None:
        raise ValueError("not the options of `supervisor run`: no command")
    config = mttr.MttrConfig(
        faults_per_kind=faults_per_kind,
        kinds=torchrun_mttr.TORCH_KINDS,
        replicas=opts.replicas,
        nodes_per_dp=opts.nodes_per_dp,
        spares=opts.spares,
        heartbeat_polling_period_s=opts.heartbeat_polling_period_s,
        heartbeat_timeout_s=opts.heartbeat_timeout_s,
        workload="torch",  # progress from the workers' log lines
        keep_dir=keep,
        # Every fault restarts all four ranks (each imports torch): 2 cores need time.
        policy_budget_s=120.0 * faults_per_kind,
        settle_steps=(40, 60),
        in_process=False,  # as `supervisor run`: a command's job restarts every rank
        supervisor_env=tuple(opts.supervisor_env.items()),
        command=tuple(opts.command),
        nproc_per_node=opts.nproc_per_node,
    )
    return dataclasses.replace(config, workload_env=job_env(config.step_time_s))


def run_mttr_rows(faults_per_kind: int, keep: Path | None) -> list[Row]:
    """Per fault kind: `supervisor run`'s job against torchrun's, both 2 nodes x 2 workers."""
    opts = run_options()
    config = mttr_config(opts, faults_per_kind, keep)
    ours = mttr.run_one(opts.policy, config, "supervisor-run")
    theirs = torchrun_mttr.run(
        torchrun_mttr.TorchrunConfig(
            faults_per_kind=faults_per_kind,
            kinds=config.kinds,
            step_time_s=config.step_time_s,
            node_repair_s=config.node_repair_s,
            workload_env=torchrun_mttr.TORCH_MTTR_ENV,
            keep_dir=keep,
            nnodes=str(NNODES),
            nproc_per_node=NPROC_PER_NODE,
        )
    )
    n = faults_per_kind
    shape = f"{NNODES}x{NPROC_PER_NODE}"
    rows: list[Row] = []
    for kind in config.kinds:
        mine = ours.of(kind)
        p50, base = (mttr_summary.p50_counting_misses(f, n) for f in (mine, theirs.of(kind)))
        ok = len(mttr_summary.recovered(mine)) == n and p50 < base
        rows += [
            Row(
                f"torch MTTR {kind} (n={n}): supervisor run {shape}",
                mttr_summary.column(mine, n),
                f"torchrun {shape}: " + mttr_summary.column(theirs.of(kind), n),
                "all recovered, MTTR p50 < torchrun's",
                verdict(ok),
            )
        ]
    rows += mttr_summary.failure_rows(
        ((f"supervisor run {shape}", ours), (f"torchrun {shape}", theirs))
    )
    rows += mttr_summary.bench_restart_rows(f"torchrun {shape}", theirs)
    return rows

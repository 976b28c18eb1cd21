"""`supervisor run [OPTIONS] -- COMMAND...` (or `supervisor run train.py ARGS`): your own
training job on a local cluster under the supervisor, launched as torchrun launches it.

Each worker gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, a MASTER_PORT fresh for every attempt,
TORCHELASTIC_RESTART_COUNT); the output comes back behind each rank; the exit code is the
job's. What cannot work is refused in one line before anything starts.
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path
from typing import Any

from resiliency_protocol.launch import CommandNotFound, resolve_command
from supervisor.config import Settings
from supervisor.local.cluster import ClusterError
from supervisor.local.cluster_state import free_port
from supervisor.local.demo import DemoOptions, LocalDemo
from supervisor.local.run import SIGNALLED, JobRun

COMMANDS = ("run",)


def add_commands(sub: Any) -> None:
    run = sub.add_parser(
        "run",
        help="Run your own training job on a local cluster under the supervisor, as "
        "torchrun would: supervisor run [OPTIONS] -- COMMAND... | train.py ARGS.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("--nnodes", type=int, default=1, help="Nodes of the job (default 1).")
    run.add_argument("--nproc-per-node", type=int, default=1, help="Workers per node (default 1).")
    run.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="Remedies in a row not followed by training progress before the supervisor "
        "gives the job up (setting max_no_progress_restarts; default 3). A job that "
        "reports no step never progresses: then, as torchrun's, the restarts in all.",
    )
    run.add_argument(
        "--spares", type=int, default=0, help="Spare nodes a failed node is swapped for."
    )
    run.add_argument(
        "--in-process",
        action="store_true",
        help="Heal in-process: the ranks a fault spared keep their processes and join a "
        "new world (the script runs its worlds through training.healing; "
        "docs/training.md, In-process recovery).",
    )
    run.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="COMMAND is a Python module, run as `python -m` (as torchrun's -m).",
    )
    run.add_argument("--job", default="job", help="The job's name (default: job).")
    run.add_argument(
        "--run-dir", type=Path, default=Path("var/run"), help="Emptied at start (var/run)."
    )
    run.add_argument("--port", type=int, help="The supervisor's port (default: a free one).")
    run.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=DemoOptions().heartbeat_timeout_s,
        help="Default %(default)g: faster than a cluster's 15 s, on one machine.",
    )
    run.add_argument(
        "--policy",
        default=DemoOptions().policy,
        help="The supervisor's policy: 'module:Class' or 'path/to/file.py:Class'.",
    )
    run.add_argument(
        "--set",
        metavar="SETTING=VALUE",
        action="append",
        default=[],
        help="Any other supervisor setting (e.g. --set restart_window_s=600); repeatable.",
    )
    run.add_argument(
        "argv",
        metavar="COMMAND",
        nargs=argparse.REMAINDER,
        help="train.py ARGS (run with this Python), or -- COMMAND ARGS (run as it is).",
    )


def settings_env(command: str, pairs: list[str]) -> dict[str, str]:
    """`--set name=value` as the supervisor's environment; an unknown name stops here."""
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in Settings.model_fields:
            raise SystemExit(
                f"supervisor {command}: --set {pair!r}: expected SETTING=VALUE, where "
                "SETTING is one of the settings in docs/configuration.md"
            )
        env[f"SUPERVISOR_{name.upper()}"] = value
    return env


def worker_command(args: argparse.Namespace) -> list[str]:
    """What each worker runs; refuses (one line) a command that cannot be found."""
    try:
        return resolve_command(list(args.argv), prog="supervisor run", module=args.module)
    except CommandNotFound as exc:
        raise SystemExit(f"supervisor run: {exc}") from None


def options(args: argparse.Namespace) -> DemoOptions:
    """The local cluster of `args`; a bad option is refused in one line."""
    for flag, value, least in (
        ("--nnodes", args.nnodes, 1),
        ("--nproc-per-node", args.nproc_per_node, 1),
        ("--max-restarts", args.max_restarts, 1),
        ("--spares", args.spares, 0),
    ):
        if value < least:
            raise SystemExit(f"supervisor run: {flag} must be at least {least}, got {value}")
    command = worker_command(args)
    defaults = {
        # The job keeps its shape: a lost node is swapped for a spare, never dropped.
        "SUPERVISOR_ENABLE_WORKLOAD_SCALING": "false",
        "SUPERVISOR_MIN_NUM_DP_REPLICAS": str(args.nnodes),
        "SUPERVISOR_MAX_NO_PROGRESS_RESTARTS": str(args.max_restarts),
    }
    return DemoOptions(
        run_dir=args.run_dir,
        port=args.port or free_port(),
        replicas=args.nnodes,
        nodes_per_dp=1,
        spares=args.spares,
        job=args.job,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        heartbeat_polling_period_s=min(1.0, args.heartbeat_timeout_s / 4),
        policy=args.policy,
        supervisor_env={**defaults, **settings_env("run", args.set)},
        command=command,
        nproc_per_node=args.nproc_per_node,
        command_in_process=args.in_process,
    )


def run(args: argparse.Namespace) -> int:
    """Start the cluster and the job, follow it to its end; the job's exit code."""
    opts = options(args)
    from supervisor.controller import PolicyLoadError, load_policy

    try:
        load_policy(opts.policy)  # here, before any process starts
    except PolicyLoadError as exc:
        raise SystemExit(f"supervisor run: --policy: {exc}") from None
    demo = LocalDemo(opts)
    caught: list[int] = []

    def stop(signum: int, _: object) -> None:
        caught.append(signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
    say = f"supervisor run: {opts.replicas} node(s) x {opts.nproc_per_node} worker(s)"
    print(f"{say}, {opts.spares} spare(s): {' '.join(opts.command or [])}", flush=True)
    job = JobRun(demo)
    try:
        demo.start()
        job.wait_known()
        print(
            f"supervisor run: the supervisor at {demo.url} (operator token "
            f"{demo.operator_token}); logs in {demo.run_dir / 'logs'}",
            flush=True,
        )
        outcome = job.wait(lambda: bool(caught))
    except (RuntimeError, ClusterError) as exc:  # a process did not come up, or start
        raise SystemExit(f"supervisor run: {exc}") from None
    finally:
        demo.stop()
    if outcome is None:
        print(f"supervisor run: stopped by signal {caught[0]}", flush=True)
        return SIGNALLED + caught[0]
    print(f"supervisor run: {outcome.why}; exit code {outcome.code}", flush=True)
    return outcome.code

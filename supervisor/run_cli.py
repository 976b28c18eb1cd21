"""`supervisor run [OPTIONS] -- COMMAND...` (or `supervisor run train.py ARGS`): your own
training job on a local cluster under the supervisor, launched as torchrun launches it.

Each worker gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, a MASTER_PORT fresh for every attempt,
TORCHELASTIC_RESTART_COUNT); the output comes back behind each rank; the exit code is the
job's. What cannot work is refused in one line before anything starts.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

from resiliency_protocol.launch import CommandNotFound, resolve_command
from supervisor.config import Settings
from supervisor.local.demo_options import DemoOptions
from supervisor.local.ports import free_port
from supervisor.local.run_folder import RunFolderError, check, default_run_dir
from supervisor.torchrun_flags import FlagRefused, TorchrunFlags, add_flags, flags_of
from training.auto_progress import startup_env

COMMANDS = ("run",)


def add_commands(sub: Any) -> None:
    run = sub.add_parser(
        "run",
        help="Run your own training job on a local cluster under the supervisor, as "
        "torchrun would: supervisor run [OPTIONS] -- COMMAND... | train.py ARGS.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "--max-restarts",
        "--max_restarts",
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
    run.add_argument(
        "--no-auto-progress",
        dest="auto_progress",
        action="store_false",
        help="Do not count a PyTorch script's optimizer steps as its progress (counted, "
        "so that a hung rank is detected, unless the script reports its own steps; as "
        "RESILIENCY_AUTO_PROGRESS=0; docs/local-mode.md).",
    )
    run.add_argument(
        "--no-warm-standby",
        dest="warm_standby",
        action="store_false",
        help="Start every rank as a new Python process, not forked from its node's warm "
        "standby (which imported the program's installed modules once; docs/local-mode.md).",
    )
    run.add_argument("--job", help="The job's name (default: --rdzv-id, else job).")
    run.add_argument(
        "--run-dir",
        type=Path,
        help="The run's folder: state, logs, checkpoints (default "
        "$XDG_STATE_HOME/resiliency-supervisor/run, XDG_STATE_HOME defaulting to "
        "~/.local/state). Created and marked as a run folder; a previous run's is emptied "
        "at start, any other folder that is not empty is refused.",
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
    add_flags(run)
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


def worker_command(args: argparse.Namespace, as_is: bool = False) -> list[str]:
    """What each worker runs (`as_is`: not with this Python); refuses (one line) a command
    that cannot be found."""
    argv = list(args.argv)
    if as_is and argv[:1] != ["--"]:
        argv.insert(0, "--")
    try:
        return resolve_command(argv, prog="supervisor run", module=args.module)
    except CommandNotFound as exc:
        raise SystemExit(f"supervisor run: {exc}") from None


def torchrun(args: argparse.Namespace) -> TorchrunFlags:
    """`args`' torchrun flags; one that cannot work is refused in one line."""
    try:
        return flags_of(args)
    except FlagRefused as exc:
        raise SystemExit(f"supervisor run: {exc}") from None


def options(args: argparse.Namespace, flags: TorchrunFlags | None = None) -> DemoOptions:
    """The local cluster of `args`; a bad option is refused in one line."""
    flags = flags or torchrun(args)
    for flag, value, least in (
        ("--max-restarts", args.max_restarts, 1),
        ("--spares", args.spares, 0),
    ):
        if value < least:
            raise SystemExit(f"supervisor run: {flag} must be at least {least}, got {value}")
    command = worker_command(args, as_is=flags.no_python)
    defaults = {
        # The job keeps its shape (a lost node is swapped for a spare, never dropped),
        # unless --nnodes MIN:MAX lets it shrink to MIN.
        "SUPERVISOR_ENABLE_WORKLOAD_SCALING": str(flags.min_nnodes < flags.nnodes).lower(),
        "SUPERVISOR_MIN_NUM_DP_REPLICAS": str(flags.min_nnodes),
        "SUPERVISOR_MAX_NO_PROGRESS_RESTARTS": str(args.max_restarts),
    }
    try:
        run_dir = (args.run_dir or default_run_dir("run")).resolve()
    except RunFolderError as exc:
        raise SystemExit(f"supervisor run: --run-dir {exc}") from None
    return DemoOptions(
        run_dir=run_dir,
        port=args.port or free_port(),
        replicas=flags.nnodes,
        nodes_per_dp=1,
        spares=args.spares,
        job=args.job or flags.rdzv_id or "job",
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        heartbeat_polling_period_s=flags.monitor_interval_s
        or min(1.0, args.heartbeat_timeout_s / 4),
        policy=args.policy,
        supervisor_env={**defaults, **settings_env("run", args.set)},
        command=command,
        nproc_per_node=flags.nproc_per_node,
        command_in_process=args.in_process,
        # PYTHONPATH for training.auto_progress: the workers count their optimizer steps.
        workload_env=startup_env(os.environ) if args.auto_progress else {},
        warm_standby=args.warm_standby,
    )


def run(args: argparse.Namespace) -> int:
    """Start the cluster and the job, follow it to its end; the job's exit code."""
    flags = torchrun(args)
    opts = options(args, flags)
    # Here, not at the top: the operators' commands share this command line and start
    # in a fraction of the time without the cluster's modules.
    from supervisor.controller import PolicyLoadError, load_policy
    from supervisor.local.cluster import ClusterError
    from supervisor.local.demo import LocalDemo
    from supervisor.local.run import SIGNALLED, JobRun

    try:
        load_policy(opts.policy)  # here, before any process starts
    except PolicyLoadError as exc:
        raise SystemExit(f"supervisor run: --policy: {exc}") from None
    try:
        check(opts.run_dir)  # before the first line: a refusal is one line
    except RunFolderError as exc:
        raise SystemExit(f"supervisor run: --run-dir {exc}") from None
    demo = LocalDemo(opts)
    caught: list[int] = []

    def stop(signum: int, _: object) -> None:
        caught.append(signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
    say = f"supervisor run: {opts.replicas} node(s) x {opts.nproc_per_node} worker(s)"
    print(f"{say}, {opts.spares} spare(s): {' '.join(opts.command or [])}", flush=True)
    print(f"supervisor run: run folder {opts.run_dir}", flush=True)
    for note in flags.notes:
        print(f"supervisor run: {note}", flush=True)
    job = JobRun(demo, shown_ranks=flags.shown_ranks)
    try:
        demo.start()  # returns once the supervisor knows every node
        print(
            f"supervisor run: the supervisor at {demo.url} (operator token "
            f"{demo.operator_token}); logs in {demo.run_dir / 'logs'}",
            flush=True,
        )
        outcome = job.wait(lambda: bool(caught))
    except RunFolderError as exc:  # taken meanwhile (the check above passed)
        raise SystemExit(f"supervisor run: --run-dir {exc}") from None
    except (RuntimeError, ClusterError) as exc:  # a process did not come up, or start
        raise SystemExit(f"supervisor run: {exc}") from None
    finally:
        demo.stop()
    if outcome is None:
        print(f"supervisor run: stopped by signal {caught[0]}", flush=True)
        return SIGNALLED + caught[0]
    print(f"supervisor run: {outcome.why}; exit code {outcome.code}", flush=True)
    return outcome.code

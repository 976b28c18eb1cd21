"""Starts the demo training job on host monitors that already run, and writes the local
cluster's state (`cluster.json`) for the supervisor's local backend.

`supervisor demo` does this for the processes it spawns itself. This is the same step
for host monitors started by something else, e.g. `docker compose up` (one container per
node, a volume shared by all, mounted at the same path everywhere):

    HOST_MONITOR_ACTUATOR_TOKEN=... python -m supervisor.local.bootstrap \\
        --run-dir /var/lib/resiliency-supervisor \\
        --node node-0=http://node-0:9400 --node node-1=http://node-1:9400 ... \\
        --replicas 2 --nodes-per-dp 2

Your own job instead of the demo's, given as `supervisor run` takes it (`train.py ARGS`,
`-m MODULE ARGS`, `-- COMMAND ARGS`), on `--nnodes` nodes of `--nproc-per-node` workers
each, with torchrun's environment:

    ... python -m supervisor.local.bootstrap --run-dir ... --node ... \
        --nnodes 2 --nproc-per-node 8 train.py --lr 0.1

The first nodes run the job (replicas x nodes-per-dp, or nnodes), the others are spares. Each run
starts a new job, as `make demo` does: workers still running from a previous one are
stopped, and its checkpoints and collectives are removed (only those a previous bootstrap
wrote: a folder that holds them without its marker is refused, untouched).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import ssl
import time
import uuid
from pathlib import Path

import httpx

from resiliency_protocol.checkpoint_reports import Tier
from resiliency_protocol.launch import resolve_command
from resiliency_protocol.shared_settings import host_monitor_env
from resiliency_protocol.tls import TLSError, client_context
from supervisor.local.cluster import ClusterError, LocalCluster
from supervisor.local.cluster_state import ClusterState, NodeInfo
from supervisor.local.demo_options import DemoOptions
from supervisor.local.run_folder import RunFolderError, clear_job_entries, job_entries
from training.auto_progress import startup_env

PROG = "python -m supervisor.local.bootstrap"
TOKEN_ENV = host_monitor_env("actuator_token")  # the host monitors' own name for this token
# What a previous job left in the run directory (see LocalCluster.worker_env).
JOB_ENTRIES = ("cluster.json", "job", Tier.DURABLE, "output", "nodes")


def _parser() -> argparse.ArgumentParser:
    d = DemoOptions()
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--run-dir", type=Path, required=True, help="Shared by every node.")
    parser.add_argument(
        "--node",
        action="append",
        required=True,
        metavar="NAME=URL",
        help="A node and the URL of its host monitor (repeat for each node).",
    )
    parser.add_argument("--job", default=d.job)
    parser.add_argument("--replicas", type=int, default=d.replicas)
    parser.add_argument("--nodes-per-dp", type=int, default=d.nodes_per_dp)
    parser.add_argument("--steps", type=int, default=d.total_steps, help="Training steps.")
    parser.add_argument("--step-time-s", type=float, default=d.step_time_s)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--wait-s", type=float, default=120.0, help="How long to wait for the host monitors."
    )
    parser.add_argument(
        "--nnodes", type=int, default=1, help="Nodes of a COMMAND's job (default 1)."
    )
    parser.add_argument(
        "--nproc-per-node", type=int, default=1, help="Workers per node of a COMMAND's job."
    )
    parser.add_argument(
        "-m", "--module", action="store_true", help="COMMAND is a Python module (python -m)."
    )
    parser.add_argument(
        "--tls-ca-file",
        help="CA bundle (PEM) that verifies host monitors at https:// URLs (the supervisor's "
        "tls_ca_file). Default: the system's trust store.",
    )
    parser.add_argument(
        "--tls-server-name",
        help="Name their certificates are checked against instead of the URL's host (the "
        "supervisor's tls_host_monitor_server_name).",
    )
    parser.add_argument(
        "argv",
        metavar="COMMAND",
        nargs=argparse.REMAINDER,
        help="The job's command, as supervisor run takes it: train.py ARGS (with this "
        "Python), -m MODULE ARGS, or -- COMMAND ARGS (as it is). None: the demo's workload.",
    )
    return parser


def parse_nodes(specs: list[str]) -> dict[str, str]:
    nodes: dict[str, str] = {}
    for spec in specs:
        name, sep, url = spec.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"--node {spec!r}: expected NAME=http://HOST:PORT")
        if name in nodes:
            raise ValueError(f"--node {name} given twice")
        nodes[name] = url.rstrip("/")
    return nodes


def _workload(args: argparse.Namespace) -> DemoOptions:
    """The job: the COMMAND given (CommandNotFound when it cannot run), else the demo's."""
    if args.argv:
        if args.nnodes < 1 or args.nproc_per_node < 1:
            raise ValueError("--nnodes and --nproc-per-node must be at least 1")
        command = resolve_command(list(args.argv), prog=PROG, module=args.module)
        return DemoOptions(
            job=args.job,
            replicas=args.nnodes,
            nodes_per_dp=1,
            command=command,
            nproc_per_node=args.nproc_per_node,
            # The workers count their optimizer steps (training.auto_progress), as under
            # supervisor run: a hung rank is seen without a line of code.
            workload_env=startup_env(os.environ),
        )
    if args.replicas < 1 or args.nodes_per_dp < 1:
        raise ValueError("--replicas and --nodes-per-dp must be at least 1")
    return DemoOptions(
        job=args.job,
        seed=args.seed,
        total_steps=args.steps,
        step_time_s=args.step_time_s,
        replicas=args.replicas,
        nodes_per_dp=args.nodes_per_dp,
    )


def build_state(args: argparse.Namespace, nodes: dict[str, str], token: str) -> ClusterState:
    workload = _workload(args)
    size = workload.replicas * workload.nodes_per_dp
    if size > len(nodes):
        raise ValueError(f"the job needs {size} nodes, {len(nodes)} given")
    return ClusterState(
        run_dir=str(args.run_dir),
        actuator_token=token,
        nodes={name: NodeInfo(address=url) for name, url in nodes.items()},
        job=workload.job_spec(list(nodes)[:size]),
    )


async def wait_for_nodes(
    state: ClusterState, wait_s: float, ssl_context: ssl.SSLContext | None = None
) -> None:
    deadline = time.monotonic() + wait_s
    headers = {"Authorization": f"Bearer {state.actuator_token}"}
    verify = ssl_context if ssl_context is not None else client_context()
    async with httpx.AsyncClient(timeout=2.0, headers=headers, verify=verify) as http:
        for name, info in state.nodes.items():
            while True:
                try:
                    response = await http.get(f"{info.address}/v1/status")
                    if response.status_code == 200:
                        break
                    problem = f"HTTP {response.status_code}"
                except httpx.TransportError as exc:
                    problem = type(exc).__name__
                if time.monotonic() > deadline:
                    raise RuntimeError(f"host monitor of {name} ({info.address}): {problem}")
                await asyncio.sleep(0.5)


async def bootstrap(
    state: ClusterState, ssl_context: ssl.SSLContext | None = None
) -> dict[str, object]:
    cluster = LocalCluster(state, ssl_context=ssl_context)
    try:
        # Workers of a previous run: stopped, and their nodes made spares again.
        nodes = list(state.nodes)
        stopped = await cluster.stop_job(nodes, grace_s=5.0, release=nodes)
        unreachable = {n: r for n, r in stopped.items() if isinstance(r, str)}
        if unreachable:
            raise RuntimeError(f"could not stop previous workers: {unreachable}")
        clear_job_entries(Path(state.run_dir), JOB_ENTRIES)
        state.save()
        # A key of its own: host monitors deduplicate start requests by id.
        return await cluster.restart_job(f"boot-{uuid.uuid4().hex[:12]}")
    finally:
        await cluster.close()


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise SystemExit(f"bootstrap: {TOKEN_ENV} is not set (the host monitors' actuator token)")
    try:
        state = build_state(args, parse_nodes(args.node), token)
        tls = client_context(
            args.tls_ca_file, server_name=args.tls_server_name, ca_name="--tls-ca-file"
        )
        # Before anything changes: what it would remove there must be a previous job's.
        job_entries(args.run_dir, JOB_ENTRIES)
        args.run_dir.mkdir(parents=True, exist_ok=True)
        asyncio.run(wait_for_nodes(state, args.wait_s, tls))
        started = asyncio.run(bootstrap(state, tls))
    except RunFolderError as exc:
        raise SystemExit(f"bootstrap: --run-dir {exc}") from None
    except (ValueError, RuntimeError, OSError, httpx.HTTPError, ClusterError, TLSError) as exc:
        raise SystemExit(f"bootstrap: {exc}") from None
    assert state.job is not None
    print(
        f"job {state.job.name!r} started (attempt {started['attempt']}) on "
        f"{', '.join(state.job.placement)}; spares: {', '.join(state.spares()) or 'none'}",
        flush=True,
    )


if __name__ == "__main__":
    main()

"""`host-monitor --launch [--nproc-per-node N] ... -- COMMAND...`: the host monitor starts
its node's workers itself, as torchrun does on each node, and has the supervisor heal them.

Each worker runs COMMAND with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, a MASTER_PORT fresh for every attempt,
TORCHELASTIC_RESTART_COUNT), computed from what the host monitor is told: its node rank,
the number of nodes and the rendezvous host (the flags torchrun takes; on a Slurm
allocation the node rank and the number of nodes default to Slurm's). The supervisor's
local backend learns of the job when the host monitor joins its cluster
(POST /api/v1/local/hosts, again until every node rank has), and restarts the workers
through this host monitor from then on, with the same environment
(resiliency_protocol/launch.py). With a supervisor, the workers start once every node
joined (torchrun's nodes start once they all met). When every worker of the node exited
with code 0 and the supervisor heard it, the host monitor exits 0, as torchrun does at the
job's end, once the supervisor says the whole job finished (torchrun's agents end
together).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import ssl
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, replace

import httpx

from host_monitor.config import HostMonitorSettings
from host_monitor.credentials import BearerCredential, CredentialError
from host_monitor.errors import HostMonitorError
from host_monitor.node import Node
from resiliency_protocol import worker_env
from resiliency_protocol.launch import (
    DEFAULT_MASTER_PORT,
    MAX_PORT,
    PORT_SPAN,
    CommandNotFound,
    HostJoin,
    HostJoined,
    job_env,
    master_port,
    ranks_of,
    rendezvous_env,
    resolve_command,
)
from resiliency_protocol.node_commands import StartWorkersRequest, WorkerSpec
from resiliency_protocol.shared_settings import HOST_MONITOR_ENV_PREFIX
from resiliency_protocol.states import WorkerState

log = logging.getLogger(__name__)

JOIN_PATH = "/api/v1/local/hosts"
DEFAULT_JOB = "job"
WATCH_S = 0.5
#: Heartbeats the supervisor must accept after the workers' end before we exit.
END_HEARTBEATS = 2
#: How often a spare never swapped in asks the supervisor whether the job finished.
SPARE_ASKS_EVERY_S = 5.0
#: How often a node whose workers are done asks it, and for how long at most.
DONE_ASKS_EVERY_S = 1.0
JOB_END_WAIT_S = 600.0


class LaunchError(HostMonitorError, ValueError):
    """A launch that cannot start (one line, naming the flag)."""


@dataclass(frozen=True)
class Launch:
    command: list[str]
    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    #: Spare hosts of the allocation: node ranks from `nnodes` on stand by for a lost host.
    spares: int = 0
    #: The job a spare stands by for (a spare host monitor itself serves no job until the
    #: supervisor swaps it in: its `job` setting stays unset).
    job: str | None = None

    @property
    def spare(self) -> bool:
        """This host stands by: no workers until the supervisor swaps it in."""
        return self.node_rank >= self.nnodes

    def start_request(self, node: str, job: str, attempt: int = 1) -> StartWorkersRequest:
        """The node's workers of `attempt`, as the supervisor's local backend starts them."""
        env = {
            **job_env(self.nnodes, self.nproc_per_node, attempt),
            **rendezvous_env(
                self.master_addr,
                master_port(self.master_port, attempt),
                self.nproc_per_node,
                attempt,
            ),
            "GROUP_RANK": str(self.node_rank),
        }
        workers = [
            WorkerSpec(rank=rank, local_rank=local)
            for local, rank in enumerate(ranks_of(self.node_rank, self.nproc_per_node))
        ]
        return StartWorkersRequest(
            request_id=f"launch-{node}-{attempt}",
            job=job,
            command=self.command,
            env=env,
            workers=workers,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "launching the node's workers (as torchrun does on each node)"
    )
    group.add_argument(
        "--launch",
        action="store_true",
        help="Start this node's workers running COMMAND (after --) with torchrun's "
        "environment; the supervisor (local backend) restarts them.",
    )
    group.add_argument("--nproc-per-node", type=int, default=1, help="Workers on this node.")
    group.add_argument(
        "--nnodes", type=int, help="Nodes of the job (default: $SLURM_NNODES, else 1)."
    )
    group.add_argument(
        "--node-rank", type=int, help="This node's rank (default: $SLURM_NODEID, else 0)."
    )
    group.add_argument(
        "--spares",
        type=int,
        default=0,
        help="Spare hosts beside the --nnodes of the job (default 0): a host whose node "
        "rank is --nnodes or more stands by, and the supervisor swaps it in for a lost one.",
    )
    group.add_argument(
        "--master-addr", default="127.0.0.1", help="Host of rank 0 (default 127.0.0.1)."
    )
    group.add_argument(
        "--master-port",
        type=int,
        default=DEFAULT_MASTER_PORT,
        help=f"MASTER_PORT of the first attempt; attempt N uses it + (N - 1) modulo "
        f"{PORT_SPAN} (default {DEFAULT_MASTER_PORT}).",
    )
    group.add_argument(
        "-m", "--module", action="store_true", help="COMMAND is a Python module (python -m)."
    )
    group.add_argument(
        "command",
        metavar="COMMAND",
        nargs=argparse.REMAINDER,
        help="-- train.py ARGS (run with this Python), or -- COMMAND ARGS (run as it is).",
    )


LAUNCH_ARGS = (
    "launch",
    "nproc_per_node",
    "nnodes",
    "spares",
    "node_rank",
    "master_addr",
    "master_port",
    "module",
    "command",
)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value and value.isdigit() else default


def launch_of(args: dict[str, object]) -> Launch | None:
    """The launch the flags ask for (None without --launch), popped from `args`; raises
    LaunchError naming what cannot work, before anything starts."""
    given = {name: args.pop(name) for name in LAUNCH_ARGS}
    command = list(given["command"] or [])  # type: ignore[call-overload]
    if not given["launch"]:
        if command:
            raise LaunchError(f"unexpected arguments {command!r}: a COMMAND needs --launch")
        return None
    if command[:1] == ["--"]:  # it only ends our flags: `-- train.py` is a script
        command = command[1:]
    try:
        module = bool(given["module"])
        resolved = resolve_command(command, prog="host-monitor --launch", module=module)
    except CommandNotFound as exc:
        raise LaunchError(str(exc)) from None
    nnodes = given["nnodes"] if given["nnodes"] is not None else _env_int("SLURM_NNODES", 1)
    rank = given["node_rank"] if given["node_rank"] is not None else _env_int("SLURM_NODEID", 0)
    launch = Launch(
        command=resolved,
        nproc_per_node=int(given["nproc_per_node"]),  # type: ignore[call-overload]
        nnodes=int(nnodes),  # type: ignore[call-overload]
        node_rank=int(rank),  # type: ignore[call-overload]
        master_addr=str(given["master_addr"]),
        master_port=int(given["master_port"]),  # type: ignore[call-overload]
        spares=int(given["spares"] or 0),  # type: ignore[call-overload]
    )
    for flag, value, least in (
        ("--nproc-per-node", launch.nproc_per_node, 1),
        ("--nnodes", launch.nnodes, 1),
        ("--spares", launch.spares, 0),
        ("--node-rank", launch.node_rank, 0),
        ("--master-port", launch.master_port, 1),
    ):
        if value < least:
            raise LaunchError(f"{flag} must be at least {least}, got {value}")
    if launch.node_rank >= launch.nnodes + launch.spares:
        spares = f" + --spares {launch.spares}" if launch.spares else ""
        raise LaunchError(
            f"--node-rank {launch.node_rank} is not below --nnodes {launch.nnodes}{spares}"
        )
    if launch.master_port > MAX_PORT - PORT_SPAN:
        raise LaunchError(f"--master-port must be at most {MAX_PORT - PORT_SPAN}")
    return launch


def spare_launch(launch: Launch, args: dict[str, object], env: MutableMapping[str, str]) -> Launch:
    """A spare's launch takes the job's name from the settings (`--job`, HOST_MONITOR_JOB,
    else the default), which then leave it unset: the host monitor of a spare serves no
    job until the supervisor starts one on it."""
    job = args.pop("job", None) or env.pop(worker_env.HOST_MONITOR_JOB, None) or DEFAULT_JOB
    return replace(launch, job=str(job))


def launch_defaults(
    args: dict[str, object], env: Mapping[str, str], *, spare: bool = False
) -> dict[str, str]:
    """Settings a launching host monitor takes unless given: its node's name (the host's
    short name, Slurm's), the job's, and `running` it from the start (`spare` for a
    spare host)."""
    given = {name for name, value in args.items() if value is not None}
    given |= {name.removeprefix(HOST_MONITOR_ENV_PREFIX).lower() for name in env}
    host = env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    defaults = {"node": host, "job": DEFAULT_JOB, "initial_state": "running"}
    if spare:
        defaults = {"node": host, "initial_state": "spare"}
    return {name: value for name, value in defaults.items() if name not in given}


class Launcher:
    """Starts the node's workers, joins the supervisor's cluster, ends with the job."""

    def __init__(
        self,
        launch: Launch,
        settings: HostMonitorSettings,
        node: Node,
        address: str,
        delivered: Callable[[], int] | None,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        self.launch = launch
        self.settings = settings
        self.node = node
        self.address = address  # where the supervisor reaches us
        # set by launch_defaults unless given; a spare's is the launch's own
        self.job = launch.job or settings.job or DEFAULT_JOB
        self._delivered = delivered  # heartbeats the supervisor accepted so far
        self._ssl = ssl_context
        self._client: httpx.AsyncClient | None = None  # while `run` runs

    async def run(self, stop: Callable[[], None]) -> None:
        """Never returns but by an exception (the workers could not start)."""
        # One client for every join and question to the supervisor, kept while we run.
        async with httpx.AsyncClient(timeout=5.0, verify=self._ssl or True) as client:
            self._client = client
            await self._launch_and_follow()
        stop()
        await asyncio.Event().wait()  # the agent stops us

    async def _launch_and_follow(self) -> None:
        # Without a supervisor, as torchrun alone: start now. With one, once every node
        # joined, unless the supervisor already runs the job (we were started again).
        if self.launch.spare:
            await self._join()
            log.info("standing by as a spare of job %s", self.job)
        elif self.settings.supervisor_url is None or await self._join():
            await self.node.start_workers(self.launch.start_request(self.node.name, self.job))
        else:
            log.warning("job %s runs already: its next restart starts our ranks", self.job)
        await self._until_the_end()

    def _join_body(self) -> dict[str, object]:
        s = self.settings
        return HostJoin(
            node=self.node.name,
            address=self.address,
            checkpoint_root=str(s.checkpoint_root),
            job=self.job,
            command=self.launch.command,
            nnodes=self.launch.nnodes,
            nproc_per_node=self.launch.nproc_per_node,
            node_rank=self.launch.node_rank,
            spares=self.launch.spares,
            master_addr=self.launch.master_addr,
            master_port=self.launch.master_port,
            attempt=1,
        ).model_dump()

    async def _ask(self) -> tuple[HostJoined | None, str]:
        """One join: (the supervisor's answer, or None and what went wrong)."""
        s = self.settings
        credential = s.supervisor_credential()
        assert credential is not None and s.supervisor_url is not None
        url = s.supervisor_url.rstrip("/") + JOIN_PATH
        try:
            header = BearerCredential.of(credential).header()
            assert self._client is not None
            response = await self._client.post(
                url, json=self._join_body(), headers={"Authorization": header}
            )
            said = f"HTTP {response.status_code}: {response.text[:300]}"
            if response.status_code != 200:
                return None, said
            return HostJoined.model_validate_json(response.content), said
        except (httpx.HTTPError, ValueError, CredentialError) as exc:
            # ValueError: pydantic's ValidationError (not a join's answer)
            return None, f"{type(exc).__name__}: {exc}"

    async def _join(self) -> bool:
        """Join the supervisor's local cluster, again until every node rank has (a
        supervisor started after us, or again meanwhile, keeps no half-joined job), or,
        for a spare, until it is known; whether to start our workers."""
        said = ""
        while True:
            answer, said_now = await self._ask()
            if answer is not None and (answer.complete or answer.spare):
                log.info("joined the supervisor's cluster: job %s", self.job)
                return answer.start
            if answer is None and said_now != said:  # once per new problem
                log.warning("cannot join the supervisor's cluster yet: %s", said_now)
            said = said_now if answer is None else ""
            await asyncio.sleep(self.settings.heartbeat_polling_period_s)

    async def _job_finished(self) -> bool:
        """Whether the supervisor says the job finished (asked once our workers are done,
        or by a spare it never used)."""
        if self.settings.supervisor_url is None:
            return False
        answer, _ = await self._ask()
        return answer is not None and answer.finished

    async def _until_the_end(self) -> None:
        """Until the job's end, as torchrun's agents end together: every worker of the
        node exited with code 0 (not stopped by us for a restart), the supervisor heard it
        and says the job finished (every rank of it exited 0; another node's ranks may
        still run, or a spare swapped in for a lost node resume them); without a word
        from it within JOB_END_WAIT_S, done anyway. A spare never swapped in waits for
        the job's end alone. Without a supervisor, once the node's workers are done."""
        ask_at = time.monotonic()
        done_since: float | None = None
        while True:
            workers = self.node.registry.statuses()
            done = bool(workers) and all(
                w.state is WorkerState.EXITED and w.exit_code == 0 for w in workers
            )
            if done and self._delivered is None:
                return
            now = time.monotonic()
            if done:
                if done_since is None:
                    done_since = now
                    await self._heard()
                    log.info("every worker of the node exited with code 0")
                if now >= ask_at:
                    ask_at = now + DONE_ASKS_EVERY_S
                    if await self._job_finished():
                        log.info("job %s finished: done", self.job)
                        return
                if now - done_since > JOB_END_WAIT_S:
                    log.warning(
                        "the supervisor did not say job %s finished within %gs: done",
                        self.job,
                        JOB_END_WAIT_S,
                    )
                    return
            else:
                done_since = None
                if not workers and self.launch.spare and now >= ask_at:
                    ask_at = now + SPARE_ASKS_EVERY_S
                    if await self._job_finished():
                        log.info("job %s finished without this spare: done", self.job)
                        return
            await asyncio.sleep(WATCH_S)

    async def _heard(self) -> None:
        """Until the supervisor accepted END_HEARTBEATS more heartbeats (bounded: a
        supervisor gone for good does not keep us)."""
        assert self._delivered is not None
        seen = self._delivered()
        for _ in range(100):
            if self._delivered() >= seen + END_HEARTBEATS:
                return
            self.node.on_change()
            await asyncio.sleep(WATCH_S / 5)

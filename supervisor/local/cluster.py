"""A local cluster: host monitor processes as nodes, a training job placed on them.

The cluster's state (nodes and their addresses, where each rank runs, which nodes are
cordoned, which actions were already carried out) lives in `cluster.json` in the run
directory, written atomically. The demo launcher creates it; the supervisor's local
backend reads and updates it, so a supervisor that is killed and started again takes
over the running job where it was.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, Field

from resiliency_protocol.emergency import emergency_checkpoint
from resiliency_protocol.tls import client_context
from supervisor.errors import SupervisorError

log = logging.getLogger(__name__)

STATE_FILE = "cluster.json"
MAX_REMEMBERED_KEYS = 1000
# The host monitor's default `checkpoint_root` (host_monitor/config.py): where its workers'
# RAM checkpoint tier must live for the peer tier to copy it.
HOST_MONITOR_CHECKPOINT_ROOT = "/dev/shm/resiliency-checkpoints"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class ClusterError(SupervisorError):
    """The cluster cannot do what was asked (no spare, no node answers, ...)."""


class InProcessFailed(ClusterError):
    """An in-process restart could not be done (the message says why): restart fully."""


class NothingToSave(ClusterError):
    """No worker of the job was there to be asked for an emergency checkpoint (none
    registered with its host monitor: a job without the worker client, or one still
    starting): asking again changes nothing."""


class NodeInfo(BaseModel):
    address: str
    # The `checkpoint_root` its host monitor runs with; None: the host monitor's default.
    checkpoint_root: str | None = None


class JobSpec(BaseModel):
    name: str
    command: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    num_dp_replicas: int = Field(ge=1)
    num_nodes_per_dp: int = Field(ge=1)
    # placement[g] is the node of group rank g (torchrun's GROUP_RANK): it runs the
    # `nproc_per_node` ranks g * nproc_per_node ... (g + 1) * nproc_per_node - 1.
    placement: list[str]
    nproc_per_node: int = Field(1, ge=1)
    attempt: int = 0
    # The action key that started the current attempt: a resumed action does not stop
    # the workers it already started, and its start requests are deduplicated.
    started_by: str | None = None
    # Nodes to stop and hand back as spares at the next restart (set with the placement).
    pending_release: list[str] = Field(default_factory=list)
    # The torch.distributed rendezvous port of the current attempt (MASTER_PORT), on rank
    # 0's node: a fresh one per attempt, so that a new world never meets ranks of the old.
    master_port: int | None = None
    # The workload can heal in-process (the torch workload): restart in place and hot-swap
    # then keep the survivors' processes and start only the replaced ranks.
    in_process_restart: bool = False
    # The node the last hot-swap put in (a resumed hot-swap starts its rank anew).
    swapped_in: str | None = None
    # Modules a warm standby of the command imports ahead of time on every node of the job
    # and on the spares (host_monitor/standby.py): a rank started anew skips that import.
    standby_preload: list[str] = Field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.placement) * self.nproc_per_node

    def ranks_of(self, group_rank: int) -> range:
        """The global ranks the node of `group_rank` runs."""
        return range(group_rank * self.nproc_per_node, (group_rank + 1) * self.nproc_per_node)


def checkpoint_partner(job: JobSpec, rank: int) -> str | None:
    """The node whose host monitor keeps copies of `rank`'s RAM checkpoints (the peer
    tier): the node of the same shard in the next data-parallel replica, so that losing a
    whole replica loses no shard; with one replica, the node of the next rank. None for a
    job of one node."""
    world = len(job.placement)
    offset = job.num_nodes_per_dp if job.num_dp_replicas > 1 else 1
    partner = job.placement[(rank + offset) % world]
    return None if partner == job.placement[rank] else partner


class ClusterState(BaseModel):
    run_dir: str
    actuator_token: str
    nodes: dict[str, NodeInfo] = Field(default_factory=dict)
    cordoned: list[str] = Field(default_factory=list)
    job: JobSpec | None = None
    done_keys: list[str] = Field(default_factory=list)

    @classmethod
    def load(cls, run_dir: Path) -> ClusterState:
        return cls.model_validate_json((run_dir / STATE_FILE).read_text())

    def save(self) -> None:
        path = Path(self.run_dir) / STATE_FILE
        tmp = path.with_suffix(".tmp")
        with tmp.open("w") as f:
            f.write(self.model_dump_json(indent=2))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def spares(self) -> list[str]:
        used = set(self.job.placement) if self.job else set()
        return sorted(n for n in self.nodes if n not in used and n not in self.cordoned)

    def remember(self, key: str) -> None:
        self.done_keys.append(key)
        del self.done_keys[:-MAX_REMEMBERED_KEYS]


class LocalCluster:
    """Operations on the cluster through the host monitors' HTTP API."""

    def __init__(
        self,
        state: ClusterState,
        *,
        stop_grace_s: float = 5.0,
        request_timeout_s: float = 10.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """`ssl_context`: how host monitors at https:// addresses are verified (default:
        the system's trust store)."""
        self.state = state
        self.stop_grace_s = stop_grace_s
        self._http = httpx.AsyncClient(
            timeout=request_timeout_s,
            headers={"Authorization": f"Bearer {state.actuator_token}"},
            verify=ssl_context if ssl_context is not None else client_context(),
        )
        self._lock = asyncio.Lock()

    @property
    def run_dir(self) -> Path:
        return Path(self.state.run_dir)

    @property
    def lock(self) -> asyncio.Lock:
        return self._lock

    async def close(self) -> None:
        await self._http.aclose()

    def job(self, name: str | None) -> JobSpec:
        job = self.state.job
        if job is None or (name is not None and job.name != name):
            raise ClusterError(f"job {name!r} is not running in this cluster")
        return job

    # --- node calls ---------------------------------------------------------------------

    async def call(
        self,
        node: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        info = self.state.nodes.get(node)
        if info is None:
            raise ClusterError(f"node {node!r} is not part of this cluster")
        url = f"{info.address}{path}"
        kwargs: dict[str, Any] = {}
        if timeout is not None:
            kwargs["timeout"] = timeout
        response = await (
            self._http.get(url, **kwargs)
            if body is None
            else self._http.post(url, json=body, **kwargs)
        )
        if response.status_code >= 400:
            raise ClusterError(f"{node}{path}: HTTP {response.status_code}: {response.text[:300]}")
        result: dict[str, Any] = response.json()
        return result

    async def reachable(self, node: str) -> bool:
        try:
            await self.call(node, "/v1/status", timeout=2.0)
        except (httpx.HTTPError, ClusterError):
            return False
        return True

    async def _each(
        self, path: str, bodies: dict[str, dict[str, Any]], *, timeout: float | None = None
    ) -> dict[str, dict[str, Any] | Exception]:
        """POST to several nodes at once; failures come back as exceptions, per node."""
        results = await asyncio.gather(
            *(self.call(n, path, body, timeout=timeout) for n, body in bodies.items()),
            return_exceptions=True,
        )
        out: dict[str, dict[str, Any] | Exception] = {}
        for node, result in zip(bodies, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result
            out[node] = result
        return out

    # --- job operations ---------------------------------------------------------------------

    def worker_env(self, job: JobSpec, node: str) -> dict[str, str]:
        run = self.run_dir
        info = self.state.nodes.get(node)
        root = (info.checkpoint_root if info else None) or HOST_MONITOR_CHECKPOINT_ROOT
        return {
            **job.env,
            "WORKLOAD_ATTEMPT": str(job.attempt),
            "NUM_DP_REPLICAS": str(job.num_dp_replicas),
            "NUM_NODES_PER_DP": str(job.num_nodes_per_dp),
            "WORLD_SIZE": str(job.world_size),
            "RUN_DIR": str(run / "job"),
            "LOCAL_CKPT_DIR": str(run / "nodes" / node / "checkpoints"),
            "DURABLE_CKPT_DIR": str(run / "durable"),
            "CHECKPOINT_DURABLE_DIR": str(run / "durable"),
            # The RAM tier: under the host monitor's checkpoint_root, so that it can copy
            # the saves to the partner node and restore the partner's copy here.
            "CHECKPOINT_RAM_DIR": str(Path(root) / node),
            "OUTPUT_DIR": str(run / "output"),
            # torch.distributed's environment, as torchrun sets it (RANK and LOCAL_RANK
            # come from the host monitor, GROUP_RANK with the start): rank 0's node hosts
            # the rendezvous store.
            **self.rendezvous_env(job),
        }

    def rendezvous_env(self, job: JobSpec) -> dict[str, str]:
        if job.master_port is None or not job.placement:
            return {}
        info = self.state.nodes.get(job.placement[0])
        host = urllib.parse.urlsplit(info.address).hostname if info else None
        return {
            "MASTER_ADDR": host or "127.0.0.1",
            "MASTER_PORT": str(job.master_port),
            "LOCAL_WORLD_SIZE": str(job.nproc_per_node),
            # Restarts of the job so far (the boot is attempt 1).
            "TORCHELASTIC_RESTART_COUNT": str(max(0, job.attempt - 1)),
        }

    async def restart_job(self, key: str) -> dict[str, Any]:
        """Stop every worker of the job, then start them all as a new attempt.

        Safe to call again with the same key after a crash: the stop is skipped once the
        start began, and the host monitors deduplicate start requests by id.
        """
        job = self.job(None)
        stopped: dict[str, Any] = {}
        if job.started_by != key:
            release = list(job.pending_release)
            nodes = sorted(set(job.placement) | set(release))
            stopped = await self.stop_job(nodes, grace_s=self.stop_grace_s, release=release)
            job.pending_release = []
            job.attempt += 1
            job.started_by = key
            job.master_port = free_port()  # local mode: every node runs on this machine
            self.state.save()
        bodies = {
            node: self._start_body(key, job, rank, node) for rank, node in enumerate(job.placement)
        }
        results = await asyncio.gather(
            *(self.call(node, "/v1/workers/start", body) for node, body in bodies.items()),
            return_exceptions=True,
        )
        failed = {
            node: str(r)
            for node, r in zip(bodies, results, strict=True)
            if isinstance(r, Exception)
        }
        if failed:
            raise ClusterError(f"could not start workers on {failed}")
        await self.prepare_spares(job)
        return {"attempt": job.attempt, "placement": list(job.placement), "stopped": stopped}

    def _start_body(self, key: str, job: JobSpec, group_rank: int, node: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "request_id": f"{key}-{node}",
            "job": job.name,
            "command": job.command,
            "env": {**self.worker_env(job, node), "GROUP_RANK": str(group_rank)},
            "workers": [
                {"rank": rank, "local_rank": local}
                for local, rank in enumerate(job.ranks_of(group_rank))
            ],
        }
        partner = checkpoint_partner(job, group_rank)
        if partner is not None and partner in self.state.nodes:
            body["checkpoint_peer"] = {"node": partner, "url": self.state.nodes[partner].address}
        if job.standby_preload:
            body["standby_preload"] = job.standby_preload
        return body

    async def prepare_spares(self, job: JobSpec) -> None:
        """Warm standbys of the job on the spares, which a hot-swap may give a rank (best
        effort: a spare that cannot is simply slower to start)."""
        if not job.standby_preload:
            return
        bodies = {
            spare: {
                "job": job.name,
                "command": job.command,
                "env": self.worker_env(job, spare),
                "preload": job.standby_preload,
            }
            for spare in self.state.spares()
        }
        for spare, result in (await self._each("/v1/standby", bodies, timeout=5.0)).items():
            if isinstance(result, Exception):
                log.info("no standby on spare %s: %s", spare, result)

    async def restart_in_process(
        self, key: str, fresh: Sequence[str], *, timeout_s: float
    ) -> dict[str, Any]:
        """Heal without restarting the survivors: the ranks on `fresh` nodes (and the nodes
        to release) are stopped and started anew, every other rank keeps its process and
        is handed a new world to join (POST /v1/workers/rejoin); done once every rank
        trains in it. Raises InProcessFailed when a node refuses, or when not every rank
        joined within `timeout_s`: the caller then restarts fully.

        Safe to call again with the same key after a crash, as `restart_job`.
        """
        job = self.job(None)
        fresh_nodes = [n for n in dict.fromkeys(fresh) if n in job.placement]
        stopped: dict[str, Any] = {}
        if job.started_by != key:
            release = list(job.pending_release)
            to_stop = sorted(set(fresh_nodes) | set(release))
            stopped = await self.stop_job(to_stop, grace_s=self.stop_grace_s, release=release)
            job.pending_release = []
            job.attempt += 1
            job.started_by = key
            job.master_port = free_port()
            self.state.save()
        attempt = str(job.attempt)
        survivors = [n for n in dict.fromkeys(job.placement) if n not in fresh_nodes]
        world = {
            "WORKLOAD_ATTEMPT": attempt,
            "WORLD_SIZE": str(job.world_size),
            **self.rendezvous_env(job),
        }
        rejoin = {
            node: {"request_id": f"{key}-{node}", "job": job.name, "attempt": attempt, "env": world}
            for node in survivors
        }
        told = await self._each("/v1/workers/rejoin", rejoin)
        refused = {n: str(r) for n, r in told.items() if isinstance(r, Exception)}
        if refused:
            raise InProcessFailed(f"survivors could not rejoin: {refused}")
        starts = {
            node: self._start_body(key, job, group, node)
            for group, node in enumerate(job.placement)
            if node in fresh_nodes
        }
        started = await self._each("/v1/workers/start", starts)
        failed = {n: str(r) for n, r in started.items() if isinstance(r, Exception)}
        if failed:
            raise InProcessFailed(f"could not start the replaced ranks: {failed}")
        await self._wait_joined(job, attempt, timeout_s)
        await self.prepare_spares(job)
        return {
            "path": "in_process",
            "attempt": job.attempt,
            "placement": list(job.placement),
            "rejoined": survivors,
            "started": fresh_nodes,
            "stopped": stopped,
        }

    async def _wait_joined(self, job: JobSpec, attempt: str, timeout_s: float) -> None:
        """Until every rank reports training in `attempt`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        waiting = {
            rank: node for group, node in enumerate(job.placement) for rank in job.ranks_of(group)
        }
        while waiting:
            for rank, node in list(waiting.items()):
                try:
                    status = await self.call(node, "/v1/status", timeout=2.0)
                except (httpx.HTTPError, ClusterError):
                    continue
                joined = any(
                    w.get("rank") == rank
                    and w.get("attempt") == attempt
                    and w.get("state") == "running"
                    for w in status.get("workers", [])
                )
                if joined:
                    del waiting[rank]
            if not waiting:
                return
            if loop.time() >= deadline:
                raise InProcessFailed(
                    f"ranks {sorted(waiting)} did not join attempt {attempt} within {timeout_s:g}s"
                )
            await asyncio.sleep(0.1)

    async def stop_job(
        self, nodes: Sequence[str], *, grace_s: float, release: Sequence[str] = ()
    ) -> dict[str, Any]:
        """Stop the workers on `nodes`; unreachable nodes are reported, not waited for."""
        bodies = {n: {"grace_s": grace_s, "release": n in release} for n in nodes}
        results = await self._each("/v1/workers/stop", bodies, timeout=grace_s + 10)
        return {
            node: f"unreachable: {type(r).__name__}"
            if isinstance(r, Exception)
            else r.get("exit_codes")
            for node, r in results.items()
        }

    async def emergency_checkpoint(
        self, key: str, job_name: str | None, exclude: Sequence[str], timeout_s: float
    ) -> dict[str, Any]:
        job = self.job(job_name)
        nodes = [n for n in dict.fromkeys(job.placement) if n not in set(exclude)]
        hosts = {n: info.address if (info := self.state.nodes.get(n)) else None for n in nodes}
        checkpoint = await emergency_checkpoint(
            self._http, hosts, request_id=key, timeout_s=timeout_s, http_timeout_s=timeout_s + 5
        )
        if not checkpoint.saved and not checkpoint.problems:
            raise NothingToSave(
                "no worker of the job is registered with its host monitor: nothing to save"
            )
        if not checkpoint.succeeded:
            raise ClusterError(f"emergency checkpoint incomplete: {checkpoint.failure}")
        # The step to resume from: the newest one at which every shard of the model (rank
        # modulo the nodes of a replica) was saved, by any replica; None if there is none
        # (success does not look at shards: every node asked may hold the same ones).
        n = job.num_nodes_per_dp
        steps_by_shard: dict[int, set[int | None]] = {}
        for rank, step in checkpoint.saved.items():
            steps_by_shard.setdefault(rank // job.nproc_per_node % n, set()).add(step)
        common = set.intersection(*steps_by_shard.values()) if len(steps_by_shard) == n else set()
        saved = max((s for s in common if s is not None), default=None)
        # `missing_nodes` stays for readers of the result; it is empty, as a node that does
        # not answer fails the checkpoint.
        return {"step": saved, "acked_ranks": sorted(checkpoint.saved), "missing_nodes": []}

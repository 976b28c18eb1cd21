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
import ssl
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel

from resiliency_protocol import worker_env
from resiliency_protocol.checkpoint_reports import Tier
from resiliency_protocol.emergency import emergency_checkpoint
from resiliency_protocol.launch import job_env, rendezvous_env
from resiliency_protocol.node_commands import (
    CheckpointPeer,
    RejoinRequest,
    StandbyRequest,
    StartWorkersRequest,
    StopWorkersRequest,
    WorkerSpec,
)
from resiliency_protocol.shared_settings import DEFAULT_CHECKPOINT_ROOT
from resiliency_protocol.states import WorkerState
from resiliency_protocol.tls import client_context
from supervisor.actuator.backend import Fenced
from supervisor.actuator.leader_epoch import stamp
from supervisor.errors import SupervisorError
from supervisor.local.cluster_state import ClusterState, JobSpec
from supervisor.local.placement import checkpoint_partner

log = logging.getLogger(__name__)

# The host monitor's default `checkpoint_root` (host_monitor/config.py): where its workers'
# RAM checkpoint tier must live for the peer tier to copy it.
#: A worker in one of these states has no process left to join a world.
ENDED = frozenset({WorkerState.EXITED.value, WorkerState.STOPPED.value})


class ClusterError(SupervisorError):
    """The cluster cannot do what was asked (no spare, no node answers, ...)."""


class InProcessFailed(ClusterError):
    """An in-process restart could not be done (the message says why): restart fully."""


class NothingToSave(ClusterError):
    """No worker of the job was there to be asked for an emergency checkpoint (none
    registered with its host monitor: a job without the worker client, or one still
    starting): asking again changes nothing."""


def request_id(key: str, node: str, attempt: int) -> str:
    """A node's start or rejoin request of an action's try in a world: sent again alike
    after a crash (the host monitor answers it again instead of acting twice), another
    one for each new world (a retry that had to start one more)."""
    return f"{key}-{node}-world-{attempt}"


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
        #: Told (job, attempt) of each newer world before any rank starts in it.
        self.on_world: Callable[[str, int], None] | None = None
        #: What the last stop on each node came to (exit codes, or why it could not).
        self.last_stops: dict[str, Any] = {}
        # Jobs logged as taking no emergency checkpoints: said once, not at every fault.
        self._told_none: set[str] = set()
        self.silent: set[str] = set()  # those the last stop got no answer from at all

    def _new_world(self, job: JobSpec) -> None:
        if self.on_world is not None:
            self.on_world(job.name, job.attempt)

    @property
    def run_dir(self) -> Path:
        return Path(self.state.run_dir)

    @property
    def lock(self) -> asyncio.Lock:
        return self._lock

    def act_in_epoch(self, epoch: int | None) -> None:
        """Send the acting supervisor's epoch with every command (a host monitor refuses
        an older one: supervisor/actuator/leader_epoch.py)."""
        stamp(self._http, epoch)

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
        body: BaseModel | None = None,
        *,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """GET `path` of `node`'s host monitor, or POST `body` (the fields set in it: one
        left out is the host monitor's default)."""
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
            else self._http.post(
                url, json=body.model_dump(mode="json", exclude_unset=True), **kwargs
            )
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
        self, path: str, bodies: Mapping[str, BaseModel], *, timeout: float | None = None
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
            if isinstance(result, Fenced):
                raise result  # a newer supervisor commands these nodes: this one must not
            out[node] = result
        return out

    # --- job operations ---------------------------------------------------------------------

    def worker_env(self, job: JobSpec, node: str) -> dict[str, str]:
        if job.hosts_master_port is not None:  # launched by its hosts: theirs, not ours
            world = job_env(len(job.placement), job.nproc_per_node, job.attempt)
            return {**job.env, **world, **self.rendezvous_env(job)}
        run = self.run_dir
        info = self.state.nodes.get(node)
        root = (info.checkpoint_root if info else None) or DEFAULT_CHECKPOINT_ROOT
        return {
            **job.env,
            worker_env.WORKLOAD_ATTEMPT: str(job.attempt),
            worker_env.NUM_DP_REPLICAS: str(job.num_dp_replicas),
            worker_env.NUM_NODES_PER_DP: str(job.num_nodes_per_dp),
            worker_env.WORLD_SIZE: str(job.world_size),
            worker_env.RUN_DIR: str(run / "job"),
            worker_env.LOCAL_CKPT_DIR: str(run / "nodes" / node / "checkpoints"),
            worker_env.DURABLE_CKPT_DIR: str(run / Tier.DURABLE),
            worker_env.CHECKPOINT_DURABLE_DIR: str(run / Tier.DURABLE),
            # The RAM tier: under the host monitor's checkpoint_root, so that it can copy
            # the saves to the partner node and restore the partner's copy here.
            worker_env.CHECKPOINT_RAM_DIR: str(Path(root) / node),
            worker_env.OUTPUT_DIR: str(run / "output"),
            # torch.distributed's environment, as torchrun sets it (RANK and LOCAL_RANK
            # come from the host monitor, GROUP_RANK with the start): rank 0's node hosts
            # the rendezvous store.
            **self.rendezvous_env(job),
        }

    def rendezvous_env(self, job: JobSpec) -> dict[str, str]:
        if job.master_port is None or not job.placement:
            return {}
        info = self.state.nodes.get(job.placement[0])
        given = job.hosts_master_addr
        if job.hosts_master_node not in (None, job.placement[0]):
            given = None  # rank 0's host was swapped for a spare: the spare's address
        host = given or (info and urllib.parse.urlsplit(info.address).hostname)
        return rendezvous_env(host or "127.0.0.1", job.master_port, job.nproc_per_node, job.attempt)

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
            job.master_port = job.next_master_port()
            self.state.save()
        self._new_world(job)
        bodies = {
            node: self._start_body(key, job, rank, node) for rank, node in enumerate(job.placement)
        }
        results = await self._each("/v1/workers/start", bodies)
        failed = {node: str(r) for node, r in results.items() if isinstance(r, Exception)}
        if failed:
            raise ClusterError(f"could not start workers on {failed}")
        await self.prepare_spares(job)
        return {"attempt": job.attempt, "placement": list(job.placement), "stopped": stopped}

    def _start_body(
        self, key: str, job: JobSpec, group_rank: int, node: str
    ) -> StartWorkersRequest:
        optional: dict[str, Any] = {
            "checkpoint_peer": self._partner(job, group_rank),
            "standby_preload": job.standby_preload or None,
        }
        return StartWorkersRequest(
            request_id=request_id(key, node, job.attempt),
            job=job.name,
            command=job.command,
            env={**self.worker_env(job, node), "GROUP_RANK": str(group_rank)},
            workers=[
                WorkerSpec(rank=rank, local_rank=local)
                for local, rank in enumerate(job.ranks_of(group_rank))
            ],
            # Left out when none: what a host monitor that predates them takes.
            **{k: v for k, v in optional.items() if v is not None},
        )

    def _partner(self, job: JobSpec, group_rank: int) -> CheckpointPeer | None:
        """The peer tier's partner of the node of `group_rank` in the current placement."""
        partner = checkpoint_partner(job, group_rank)
        info = self.state.nodes.get(partner) if partner is not None else None
        return None if info is None else CheckpointPeer(node=str(partner), url=info.address)

    async def warm_standbys(self, job: JobSpec, nodes: Sequence[str], within_s: float) -> None:
        """Standbys of the job on `nodes`, waited for until each has imported its modules
        or `within_s` passed: a start on a warm node forks its ranks (one import for the
        node, where launching costs one per rank and the standby's after). A node not warm
        in time launches its ranks as usual."""
        bodies = self._standby_bodies(job, nodes)
        deadline = asyncio.get_running_loop().time() + within_s
        while bodies:
            results = await self._each("/v1/standby", bodies, timeout=5.0)
            for node, result in results.items():
                # Warm, or it cannot have one: asked enough.
                if isinstance(result, dict) and (result.get("warm") or not result.get("ready")):
                    del bodies[node]
            if not bodies or asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(0.25)
        if bodies:
            log.info("standbys not warm within %gs on %s", within_s, sorted(bodies))

    async def prepare_spares(self, job: JobSpec) -> None:
        """Warm standbys of the job on the spares, which a hot-swap may give a rank (best
        effort: a spare that cannot is simply slower to start)."""
        bodies = self._standby_bodies(job, self.state.spares())
        for spare, result in (await self._each("/v1/standby", bodies, timeout=5.0)).items():
            if isinstance(result, Exception):
                log.info("no standby on spare %s: %s", spare, result)

    def _standby_bodies(self, job: JobSpec, nodes: Sequence[str]) -> dict[str, StandbyRequest]:
        """What each of `nodes` is asked for its standby of the job (none: no preload)."""
        if not job.standby_preload:
            return {}
        return {
            node: StandbyRequest(
                job=job.name,
                command=job.command,
                env=self.worker_env(job, node),
                preload=job.standby_preload,
            )
            for node in nodes
        }

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
            job.master_port = job.next_master_port()
            self.state.save()
            if self.silent:
                # Cut off, its ranks may train on with the survivors, whose collectives then
                # never fail to make them look for the new world: a full restart ends it.
                raise InProcessFailed(
                    f"{sorted(self.silent)} did not answer the stop (cut off?): its ranks "
                    "may still train with the survivors in the old world"
                )
        attempt = str(job.attempt)
        survivors = [n for n in dict.fromkeys(job.placement) if n not in fresh_nodes]
        world = {
            worker_env.WORKLOAD_ATTEMPT: attempt,
            worker_env.WORLD_SIZE: str(job.world_size),
            **self.rendezvous_env(job),
        }
        rejoin = {
            node: RejoinRequest(
                request_id=request_id(key, node, job.attempt),
                job=job.name,
                attempt=attempt,
                env=world,
                # The placement changed: each survivor's partner follows it (null: none).
                checkpoint_peer=self._partner(job, job.placement.index(node)),
            )
            for node in survivors
        }
        told = await self._each("/v1/workers/rejoin", rejoin)
        refused = {n: str(r) for n, r in told.items() if isinstance(r, Exception)}
        if refused:
            raise InProcessFailed(f"survivors could not rejoin: {refused}")
        self._new_world(job)  # every survivor knows the new world: the old one is fenced
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
        """Until every rank reports training in `attempt`; InProcessFailed past `timeout_s`,
        or at once when a rank's process ended before it joined (waiting on would only
        spend the timeout: the world cannot form without it)."""
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
                mine = [w for w in status.get("workers", []) if w.get("rank") == rank]
                if any(w.get("attempt") == attempt and w.get("state") == "running" for w in mine):
                    del waiting[rank]
                elif any(w.get("state") in ENDED for w in mine):
                    raise InProcessFailed(
                        f"rank {rank} on {node} ended before it joined attempt {attempt}"
                    )
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
        bodies = {n: StopWorkersRequest(grace_s=grace_s, release=n in release) for n in nodes}
        results = await self._each("/v1/workers/stop", bodies, timeout=grace_s + 10)
        outcomes = {
            node: f"unreachable: {type(r).__name__}"
            if isinstance(r, Exception)
            else r.get("exit_codes")
            for node, r in results.items()
        }
        self.last_stops.update(outcomes)
        # No answer at all (not even a refused connection): cut off, not down.
        self.silent = {n for n, r in results.items() if isinstance(r, httpx.TimeoutException)}
        return outcomes

    async def emergency_checkpoint(
        self, key: str, job_name: str | None, exclude: Sequence[str], timeout_s: float
    ) -> dict[str, Any]:
        job = self.job(job_name)
        nodes = [n for n in dict.fromkeys(job.placement) if n not in set(exclude)]
        hosts = {n: info.address if (info := self.state.nodes.get(n)) else None for n in nodes}
        checkpoint = await emergency_checkpoint(
            self._http,
            hosts,
            request_id=key,
            timeout_s=timeout_s,
            http_timeout_s=timeout_s + 5,
            reraise=(Fenced,),
        )
        if checkpoint.takes_none:
            note = checkpoint.none_asked(job.name)
            first = job.name not in self._told_none
            self._told_none.add(job.name)
            log.log(
                logging.INFO if first else logging.DEBUG, "emergency checkpoint %s: %s", key, note
            )
            # Nothing failed: the remedy after it goes on as it would after a save.
            return {
                "step": None,
                "steps": [],
                "acked_ranks": [],
                "missing_nodes": [],
                "emergency_checkpoints": False,
                "note": note,
            }
        if not checkpoint.saved and not checkpoint.problems:
            raise NothingToSave(checkpoint.none_asked(job.name))
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
        # not answer fails the checkpoint. `steps`: every step saved, as the Kubernetes
        # backend reports them (ranks a fault split may hold two: a sharded job's layout
        # is the job's, so `step` may name one not every shard reached).
        return {
            "step": saved,
            "steps": checkpoint.steps,
            "acked_ranks": sorted(checkpoint.saved),
            "missing_nodes": [],
        }

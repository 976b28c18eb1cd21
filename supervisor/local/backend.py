"""The local backend: carries out actions on a local cluster of host monitor processes.

Every action is idempotent: it is skipped when its key is already recorded in the
cluster state, and each step checks the state it leaves behind (a node already swapped
out is not swapped again; a job already started under this key is not started again),
so an action resumed after a supervisor crash finishes what the first run began.

"Restart in place" and "restart workload" restart every worker of the job on the nodes
it runs on: the job is synchronous, so one rank cannot rejoin the others' step alone
(torchrun does the same). Hot-swap, scale down and scale up change the placement first,
then restart. A job that can heal in-process (`JobSpec.in_process_restart`, the torch
workload; a policy may ask for either path with the action's `in_process` param) is
healed that way on restart in place and hot-swap: only the failed node's rank starts anew
(from a warm standby when there is one), the survivors keep their processes and join a
new world; past `in_process_restart_timeout_s`, or when a node refuses, every rank is
restarted, and the action's result says which path was taken and why.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from supervisor.action_params import (
    CordonParams,
    EmergencyCheckpointParams,
    HotSwapParams,
    RestartInPlaceParams,
    RestartWorkloadParams,
    ScaleDownParams,
    ScaleUpParams,
    UncordonParams,
)
from supervisor.actuator.backend import ActionError, Backend, checked_params
from supervisor.config import Settings
from supervisor.domain import ActionRecord, ActionType
from supervisor.local.cluster import (
    ClusterError,
    ClusterState,
    InProcessFailed,
    JobSpec,
    LocalCluster,
    NothingToSave,
)

log = logging.getLogger(__name__)

PROCESS_FAULTS = frozenset({"worker_crash", "worker_hang", "straggler", "xid", "ecc", "node_down"})


class LocalBackend(Backend):
    name = "local"
    process_faults = PROCESS_FAULTS

    def __init__(self, run_dir: Path, settings: Settings) -> None:
        try:
            state = ClusterState.load(run_dir)
        except FileNotFoundError:
            raise ValueError(f"no local cluster in {run_dir} (cluster.json missing)") from None
        self.cluster = LocalCluster(
            state,
            stop_grace_s=settings.local_stop_grace_s,
            ssl_context=settings.host_monitor_ssl_context(),
        )
        self.settings = settings

    async def close(self) -> None:
        await self.cluster.close()

    async def execute(self, action: ActionRecord) -> Mapping[str, Any]:
        cluster = self.cluster
        async with cluster.lock:
            if action.idempotency_key in cluster.state.done_keys:
                return {"repeated": True}
            try:
                result = await self._dispatch(action)
            except NothingToSave as exc:
                raise ActionError(str(exc)) from None
            except ClusterError as exc:
                raise ActionError(str(exc), retryable=True) from None
            except httpx.HTTPError as exc:
                raise ActionError(f"{type(exc).__name__}: {exc}", retryable=True) from None
            cluster.state.remember(action.idempotency_key)
            cluster.state.save()
            return result

    async def _dispatch(self, action: ActionRecord) -> dict[str, Any]:
        key = action.idempotency_key
        if action.type is ActionType.FORCE_DELETE_POD:  # no pods here
            raise ActionError(f"local backend cannot {action.type.value}")
        match checked_params(action):
            case EmergencyCheckpointParams(exclude_nodes=exclude):
                # Leave the workers some of the actuator's time to answer before it gives up.
                budget = max(0.5, self.settings.emergency_checkpoint_timeout_s * 0.9)
                return await self.cluster.emergency_checkpoint(key, action.job, exclude, budget)
            case RestartInPlaceParams(in_process=in_process):
                job = self.cluster.job(action.job)
                if self._in_process(in_process, job) and action.node in job.placement:
                    return await self._restart(key, [action.node])
                return await self.cluster.restart_job(key)
            case RestartWorkloadParams():
                self.cluster.job(action.job)
                return await self.cluster.restart_job(key)
            case HotSwapParams(spare=spare, in_process=in_process):
                job = self.cluster.job(action.job)
                return await self._hot_swap(
                    key, action.job, action.node, spare, self._in_process(in_process, job)
                )
            case ScaleDownParams(to_replicas=to, exclude_node=excluded):
                return await self._scale(key, action.job, to, excluded)
            case ScaleUpParams(to_replicas=to):
                return await self._scale(key, action.job, to, None)
            case UncordonParams():
                result = self._cordon(action.node, False)
                if self.cluster.state.job is not None:  # a spare again: warm it up
                    await self.cluster.prepare_spares(self.cluster.state.job)
                return result
            case CordonParams():
                return self._cordon(action.node, True)
        raise ActionError(f"local backend cannot {action.type.value}")

    # --- actions ---------------------------------------------------------------------------

    @staticmethod
    def _in_process(wanted: bool | None, job: JobSpec) -> bool:
        """Whether to heal in-process: the policy's choice (params `in_process`), else the
        job's default."""
        return bool(job.in_process_restart if wanted is None else wanted)

    async def _restart(self, key: str, fresh: list[str]) -> dict[str, Any]:
        """In-process restart of the survivors with new ranks on `fresh`; a full restart
        when that fails or takes longer than `in_process_restart_timeout_s` (the result
        says which path was taken, and why)."""
        try:
            return await self.cluster.restart_in_process(
                key, fresh, timeout_s=self.settings.in_process_restart_timeout_s
            )
        except InProcessFailed as exc:
            log.warning("in-process restart %s failed, restarting every rank: %s", key, exc)
            result = await self.cluster.restart_job(f"{key}/full")
            return {"path": "full_restart", "in_process_error": str(exc), **result}

    async def _hot_swap(
        self,
        key: str,
        job_name: str | None,
        node: str | None,
        wanted: object,
        in_process: bool = False,
    ) -> dict[str, Any]:
        state = self.cluster.state
        job = self.cluster.job(job_name)
        if node is None:
            raise ActionError("hot_swap needs a node")
        spare = str(wanted) if wanted else ""
        if node in job.placement:
            spare = await self._pick_spare(spare or None)
            job.placement = [spare if n == node else n for n in job.placement]
            job.pending_release.append(node)
            job.swapped_in = spare
            if node not in state.cordoned:
                state.cordoned.append(node)
            state.save()
        elif not spare:
            spare = job.swapped_in or ""  # resumed after a crash: the swap is recorded
        if in_process and spare:
            result = await self._restart(key, [spare])
        else:
            result = await self.cluster.restart_job(key)
        return {"replaced": node, "by": spare, **result}

    async def _pick_spare(self, wanted: str | None) -> str:
        spares = self.cluster.state.spares()
        candidates = ([wanted] if wanted in spares else []) + [s for s in spares if s != wanted]
        for spare in candidates:
            if spare and await self.cluster.reachable(spare):
                return spare
        raise ClusterError("no reachable spare node")

    async def _scale(
        self, key: str, job_name: str | None, to_replicas: int, exclude: str | None
    ) -> dict[str, Any]:
        state = self.cluster.state
        job = self.cluster.job(job_name)
        n = job.num_nodes_per_dp
        lo, hi = self.settings.min_num_dp_replicas, self.settings.max_num_dp_replicas
        if not lo <= to_replicas <= hi:
            raise ActionError(f"to_replicas={to_replicas} outside [{lo}, {hi}]")
        if to_replicas != job.num_dp_replicas:
            replicas = [job.placement[i * n : (i + 1) * n] for i in range(job.num_dp_replicas)]
            if to_replicas < job.num_dp_replicas:
                # Drop the replica holding the bad node first, then the last ones.
                replicas.sort(key=lambda nodes: exclude in nodes)
                kept, dropped = replicas[:to_replicas], replicas[to_replicas:]
                job.pending_release.extend(node for r in dropped for node in r)
                if isinstance(exclude, str) and exclude not in state.cordoned:
                    state.cordoned.append(exclude)
            else:
                wanted = (to_replicas - job.num_dp_replicas) * n
                spares = [s for s in state.spares() if await self.cluster.reachable(s)]
                if len(spares) < wanted:
                    raise ClusterError(f"scale up needs {wanted} spare nodes, {len(spares)} ready")
                kept = replicas + [spares[i * n : (i + 1) * n] for i in range(wanted // n)]
            job.placement = [node for r in kept for node in r]
            job.num_dp_replicas = to_replicas
            state.save()
        result = await self.cluster.restart_job(key)
        return {"num_dp_replicas": job.num_dp_replicas, **result}

    def _cordon(self, node: str | None, cordon: bool) -> dict[str, Any]:
        state = self.cluster.state
        if node is None or node not in state.nodes:
            raise ActionError(f"node {node!r} is not part of this cluster")
        if cordon and node not in state.cordoned:
            state.cordoned.append(node)
        elif not cordon and node in state.cordoned:
            state.cordoned.remove(node)
        return {"cordoned": sorted(state.cordoned)}

    # --- process-level faults -------------------------------------------------------------

    async def inject_fault(
        self, kind: str, node: str, params: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        if kind not in PROCESS_FAULTS:
            return await super().inject_fault(kind, node, params)
        body = {"kind": kind, **{k: v for k, v in params.items() if v is not None}}
        try:
            return await self.cluster.call(node, "/v1/faults", body, timeout=5.0)
        except httpx.HTTPError as exc:
            if kind == "node_down":  # the node died while answering: that is the point
                return {"kind": kind, "node": node}
            raise ActionError(f"cannot reach {node}: {exc}") from None
        except ClusterError as exc:
            raise ActionError(str(exc)) from None

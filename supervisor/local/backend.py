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
restarted, and the action's result says which path was taken and why. A hot-swap whose
old node does not answer at all (cut off, not down) restarts every rank: its ranks may
still train with the survivors in the old world. Its result says what became of the old
node's workers (`old_worker`).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Protocol

import httpx
from pydantic import SecretStr, ValidationError

from resiliency_protocol.faults import FAULTS, PROCESS_FAULT_KINDS, FaultKind
from resiliency_protocol.launch import HostJoin
from resiliency_protocol.node_commands import ProcessFault
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
from supervisor.actuator.backend import (
    ActionError,
    ActionTable,
    Backend,
    Refused,
    dispatch,
    params_for,
)
from supervisor.domain import ActionRecord, ActionType
from supervisor.local.cluster import ClusterError, InProcessFailed, LocalCluster, NothingToSave
from supervisor.local.cluster_state import ClusterState, JobSpec
from supervisor.local.hosts import HostJoins

log = logging.getLogger(__name__)


def old_worker(node: str, stopped: Mapping[str, Any], world: int) -> dict[str, Any]:
    """What became of the swapped-out node's workers: `stopped` (its host monitor
    answered the stop: their exit codes), `unreachable` (no answer: they may still run;
    the supervisor refuses their reports as of an older world than `world`, and their
    host monitor kills them when it is heard again) or `not_known` (stopped by an earlier
    run of this action, before a supervisor restart)."""
    outcome = stopped.get(node)
    fenced = {"node": node, "fenced_below_world": world}
    if outcome is None:
        return {**fenced, "status": "not_known"}
    if isinstance(outcome, str):
        return {**fenced, "status": "unreachable", "may_still_run": True, "error": outcome}
    return {**fenced, "status": "stopped", "exit_codes": outcome}


class LocalBackendSettings(Protocol):
    """What the local backend reads, across groups: its own (the stop grace), the host
    monitors' token and TLS, the actuator's checkpoint timeout, the in-process wait, and
    the workload's replica bounds."""

    @property
    def local_stop_grace_s(self) -> float: ...
    @property
    def host_monitor_actuator_token(self) -> SecretStr | None: ...
    def host_monitor_ssl_context(self) -> ssl.SSLContext: ...
    @property
    def emergency_checkpoint_timeout_s(self) -> float: ...
    @property
    def in_process_wait_s(self) -> float: ...
    @property
    def min_num_dp_replicas(self) -> int: ...
    @property
    def max_num_dp_replicas(self) -> int: ...


class LocalBackend(Backend):
    name = "local"
    process_faults = PROCESS_FAULT_KINDS

    def __init__(self, run_dir: Path, settings: LocalBackendSettings) -> None:
        try:
            state = ClusterState.load(run_dir)
        except FileNotFoundError:
            token = settings.host_monitor_actuator_token
            if token is None:
                raise ValueError(
                    f"no local cluster in {run_dir} (cluster.json missing), and no "
                    "host_monitor_actuator_token for hosts to join it (host-monitor --launch)"
                ) from None
            # Empty until hosts that launched their own workers join it.
            run_dir.mkdir(parents=True, exist_ok=True)
            state = ClusterState(run_dir=str(run_dir), actuator_token=token.get_secret_value())
            state.save()
        self.cluster = LocalCluster(
            state,
            stop_grace_s=settings.local_stop_grace_s,
            ssl_context=settings.host_monitor_ssl_context(),
        )
        self.settings = settings
        self.cluster.on_world = self.world_started
        self.hosts = HostJoins(state, self.world_started)

    def act_in_epoch(self, epoch: int | None) -> None:
        self.cluster.act_in_epoch(epoch)

    def worlds(self) -> Mapping[str, int]:
        job = self.cluster.state.job
        return {} if job is None else {job.name: job.attempt}

    async def close(self) -> None:
        await self.cluster.close()

    async def join_host(self, host: HostJoin) -> dict[str, Any]:
        """A host that launched its node's workers joins the cluster (hosts.py)."""
        async with self.cluster.lock:  # not while an action changes the cluster
            return self.hosts.join(host)

    async def execute(self, action: ActionRecord) -> Mapping[str, Any]:
        cluster = self.cluster
        async with cluster.lock:
            if action.idempotency_key in cluster.state.done_keys:
                return {"repeated": True}
            try:
                result = await dispatch(self.name, self.actions, self, action)
            except NothingToSave as exc:
                raise ActionError(str(exc)) from None
            except ClusterError as exc:
                raise ActionError(str(exc), retryable=True) from None
            except httpx.HTTPError as exc:
                raise ActionError(f"{type(exc).__name__}: {exc}", retryable=True) from None
            cluster.state.remember(action.idempotency_key)
            cluster.state.save()
            return result

    # --- actions ---------------------------------------------------------------------------

    async def _emergency_checkpoint(self, action: ActionRecord) -> dict[str, Any]:
        exclude = params_for(action, EmergencyCheckpointParams).exclude_nodes
        # Leave the workers some of the actuator's time to answer before it gives up.
        budget = max(0.5, self.settings.emergency_checkpoint_timeout_s * 0.9)
        key = action.idempotency_key
        return await self.cluster.emergency_checkpoint(key, action.job, exclude, budget)

    async def _restart_in_place(self, action: ActionRecord) -> dict[str, Any]:
        in_process = params_for(action, RestartInPlaceParams).in_process
        job = self.cluster.job(action.job)
        if self._in_process(in_process, job) and action.node in job.placement:
            return await self._restart(action.idempotency_key, [action.node])
        return await self.cluster.restart_job(action.idempotency_key)

    async def _restart_workload(self, action: ActionRecord) -> dict[str, Any]:
        params_for(action, RestartWorkloadParams)  # none, but checked as every type's are
        self.cluster.job(action.job)
        return await self.cluster.restart_job(action.idempotency_key)

    async def _hot_swap(self, action: ActionRecord) -> dict[str, Any]:
        params = params_for(action, HotSwapParams)
        in_process = self._in_process(params.in_process, self.cluster.job(action.job))
        return await self._swap(
            action.idempotency_key, action.job, action.node, params.spare, in_process
        )

    async def _scale_down(self, action: ActionRecord) -> dict[str, Any]:
        params = params_for(action, ScaleDownParams)
        return await self._scale(
            action.idempotency_key, action.job, params.to_replicas, params.exclude_node
        )

    async def _scale_up(self, action: ActionRecord) -> dict[str, Any]:
        to = params_for(action, ScaleUpParams).to_replicas
        return await self._scale(action.idempotency_key, action.job, to, None)

    async def _cordon(self, action: ActionRecord) -> dict[str, Any]:
        params_for(action, CordonParams)
        return self._set_cordoned(action.node, True)

    async def _uncordon(self, action: ActionRecord) -> dict[str, Any]:
        params_for(action, UncordonParams)
        result = self._set_cordoned(action.node, False)
        if self.cluster.state.job is not None:  # a spare again: warm it up
            await self.cluster.prepare_spares(self.cluster.state.job)
        return result

    actions: ClassVar[ActionTable[LocalBackend]] = {
        ActionType.EMERGENCY_CHECKPOINT: _emergency_checkpoint,
        ActionType.RESTART_IN_PLACE: _restart_in_place,
        ActionType.RESTART_WORKLOAD: _restart_workload,
        ActionType.HOT_SWAP: _hot_swap,
        ActionType.SCALE_DOWN: _scale_down,
        ActionType.SCALE_UP: _scale_up,
        ActionType.CORDON: _cordon,
        ActionType.UNCORDON: _uncordon,
        ActionType.FORCE_DELETE_POD: Refused("no pods here"),
    }

    # --- how actions are done --------------------------------------------------------------

    @staticmethod
    def _in_process(wanted: bool | None, job: JobSpec) -> bool:
        """Whether to heal in-process: the policy's choice (params `in_process`), else the
        job's default."""
        return bool(job.in_process_restart if wanted is None else wanted)

    async def _restart(self, key: str, fresh: list[str]) -> dict[str, Any]:
        """In-process restart of the survivors with new ranks on `fresh`; a full restart
        when that fails or takes longer than `in_process_restart_timeout_s` (the result
        says which path was taken, and why)."""
        full = f"{key}/full"
        if self.cluster.job(None).started_by == full:
            # A retry after the full restart began (a node failed to start): that world's
            # starts are sent again, as they were; no second in-process try, no new world.
            why = "an earlier try of this action gave way to a full restart"
            return {
                "path": "full_restart",
                "in_process_error": why,
                **await self.cluster.restart_job(full),
            }
        try:
            return await self.cluster.restart_in_process(
                key, fresh, timeout_s=self.settings.in_process_wait_s
            )
        except InProcessFailed as exc:
            log.warning("in-process restart %s failed, restarting every rank: %s", key, exc)
            result = await self.cluster.restart_job(full)
            return {"path": "full_restart", "in_process_error": str(exc), **result}

    async def _swap(
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
        silent = in_process and spare and await self._silent(node)
        if silent:
            # Cut off, not down: its rank may still train with the survivors in the old
            # world, and an in-process heal would leave them at it until the stop gives
            # up on it. Stopping every rank at once ends that world now.
            why = f"{node} does not answer (cut off?): its ranks may still train with the survivors"
            log.warning("hot-swap %s: restarting every rank: %s", key, why)
            result = {
                "path": "full_restart",
                "in_process_error": why,
                # The key of the in-process path's fallback: a retry that finds the node
                # answering again goes on with this world rather than try in-process.
                **await self.cluster.restart_job(f"{key}/full"),
            }
        elif in_process and spare:
            result = await self._restart(key, [spare])
        else:
            result = await self.cluster.restart_job(key)
        return {
            "replaced": node,
            "by": spare,
            # The in-process path may have stopped it before falling back to a full restart.
            "old_worker": old_worker(
                node, {**self.cluster.last_stops, **result.get("stopped", {})}, job.attempt
            ),
            **result,
        }

    async def _silent(self, node: str) -> bool:
        """No answer at all within 2 s, not even a refused connection: the node is cut
        off, not down (a node whose host monitor is gone refuses at once)."""
        try:
            await self.cluster.call(node, "/v1/status", timeout=2.0)
        except httpx.TimeoutException:
            return True
        except (httpx.HTTPError, ClusterError):
            return False
        return False

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

    def _set_cordoned(self, node: str | None, cordon: bool) -> dict[str, Any]:
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
        self, kind: FaultKind, node: str, params: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        if kind not in PROCESS_FAULT_KINDS:
            return await super().inject_fault(kind, node, params)
        try:
            body = ProcessFault.model_validate(
                {"kind": kind, **{k: v for k, v in params.items() if v is not None}}
            )
        except ValidationError as exc:  # what the host monitor would refuse with 422
            raise ActionError(f"{node}/v1/faults: {exc}") from None
        try:
            return await self.cluster.call(node, "/v1/faults", body, timeout=5.0)
        except httpx.HTTPError as exc:
            if FAULTS[kind].agent_exits:  # the node died while answering: that is the point
                return {"kind": kind, "node": node}
            raise ActionError(f"cannot reach {node}: {exc}") from None
        except ClusterError as exc:
            raise ActionError(str(exc)) from None

"""The simulated backend: the supervisor's actions carried out on the simulated cluster
(cluster.py), each type by its handler in `SimulatedBackend.actions`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from supervisor.action_params import (
    EmergencyCheckpointParams,
    HotSwapParams,
    ScaleDownParams,
    ScaleUpParams,
)
from supervisor.actuator.backend import (
    ActionError,
    ActionTable,
    Backend,
    BackendHooks,
    ClusterNode,
    dispatch,
    params_for,
)
from supervisor.domain import ActionRecord, ActionType, JobView
from supervisor.goodput.model import ReplicaChange
from supervisor.simulate.cluster import SimulatedCluster


async def emergency_checkpoint(
    cluster: SimulatedCluster, action: ActionRecord
) -> Mapping[str, Any]:
    excluded = set(params_for(action, EmergencyCheckpointParams).exclude_nodes)
    missing = [n.name for n in cluster.job_nodes() if not n.up or n.name in excluded]
    if missing and cluster.job.emergency_checkpoint_survives == "process":
        raise ActionError(
            f"nodes {', '.join(missing)} cannot save and their state has no copy elsewhere"
        )
    return {"simulated": True, "step": await cluster.emergency_save()}


async def cordon(cluster: SimulatedCluster, action: ActionRecord) -> Mapping[str, Any]:
    return _set_cordoned(cluster, action, True)


async def uncordon(cluster: SimulatedCluster, action: ActionRecord) -> Mapping[str, Any]:
    return _set_cordoned(cluster, action, False)


def _set_cordoned(
    cluster: SimulatedCluster, action: ActionRecord, cordoned: bool
) -> dict[str, Any]:
    node = cluster.nodes.get(action.node or "")
    if node is None:
        raise ActionError(f"node: {action.node!r} is not a simulated node")
    node.cordoned = cordoned
    if cordoned and node.up and node.slot is None:
        cluster.to_repair(node)
    return {"simulated": True}


async def force_delete_pod(cluster: SimulatedCluster, action: ActionRecord) -> Mapping[str, Any]:
    return {"simulated": True}  # no pods: nothing is ever stuck terminating


def _of_the_job(cluster: SimulatedCluster, action: ActionRecord) -> None:
    if action.job not in (None, cluster.job.name):
        raise ActionError(f"job: {action.job!r} is not the simulated job")


def _job_result(cluster: SimulatedCluster) -> Mapping[str, Any]:
    return {"simulated": True, "state": cluster.state, "replicas": cluster.replicas}


async def restart_in_place(cluster: SimulatedCluster, action: ActionRecord) -> Mapping[str, Any]:
    _of_the_job(cluster, action)
    down = [n.name for n in cluster.job_nodes() if not n.up]
    if down:
        raise ActionError(f"nodes {', '.join(down)} are down: cannot restart in place")
    cluster.stall("restart in place")
    cluster.begin_attempt(startup_s=cluster.job.in_place_restart_s)
    return _job_result(cluster)


async def restart_workload(cluster: SimulatedCluster, action: ActionRecord) -> Mapping[str, Any]:
    _of_the_job(cluster, action)
    cluster.stall("restart workload")
    for node in cluster.job_nodes():
        if not node.up:
            cluster.vacate(node)
    cluster.begin_attempt(startup_s=cluster.job.startup_s)
    return _job_result(cluster)


async def hot_swap(cluster: SimulatedCluster, action: ActionRecord) -> Mapping[str, Any]:
    _of_the_job(cluster, action)
    old = cluster.nodes.get(action.node or "")
    wanted = params_for(action, HotSwapParams).spare
    spare = cluster.nodes.get(wanted or "")
    if old is None or old.slot is None:
        raise ActionError(f"node: {action.node!r} does not run the job")
    if spare is None or spare not in cluster.free():
        raise ActionError(f"params.spare: {wanted!r} is not a free spare")
    cluster.stall(f"hot swap of {old.name}")
    slot = old.slot
    cluster.vacate(old)
    old.cordoned = True
    cluster.to_repair(old)
    spare.slot = slot
    cluster.slots[slot] = spare.name
    cluster.counters.spares_used += 1
    if old.up:  # its host monitor says it left the job
        await cluster.report(old)
    cluster.begin_attempt(startup_s=cluster.job.startup_s)
    return _job_result(cluster)


async def scale_down(cluster: SimulatedCluster, action: ActionRecord) -> Mapping[str, Any]:
    _of_the_job(cluster, action)
    params = params_for(action, ScaleDownParams)
    await _scale(cluster, params.to_replicas, params.exclude_node)
    return _job_result(cluster)


async def scale_up(cluster: SimulatedCluster, action: ActionRecord) -> Mapping[str, Any]:
    _of_the_job(cluster, action)
    await _scale(cluster, params_for(action, ScaleUpParams).to_replicas, None)
    return _job_result(cluster)


async def _scale(cluster: SimulatedCluster, to: int, exclude: str | None) -> None:
    if not 1 <= to <= cluster.max_replicas:
        raise ActionError(f"params.to_replicas: {to!r} is not between 1 and {cluster.max_replicas}")
    k = cluster.model.num_nodes_per_dp
    cluster.stall(f"scale to {to}")
    if to < cluster.replicas:
        excluded = cluster.nodes.get(exclude or "")
        for _ in range(cluster.replicas - to):
            replica = cluster.replicas - 1
            if excluded is not None and excluded.slot is not None:
                replica = excluded.slot // k
            _drop_replica(cluster, replica)
            excluded = None
    else:
        need = (to - cluster.replicas) * k
        if len(cluster.free()) < need:
            raise ActionError(f"params.to_replicas: {to} needs {need} free nodes")
    cluster.replicas = to
    cluster.records.append(ReplicaChange(cluster.now(), to, cluster.max_replicas))
    cluster.begin_attempt(startup_s=cluster.job.startup_s)
    await cluster.report_left()


def _drop_replica(cluster: SimulatedCluster, replica: int) -> None:
    """Take replica `replica` out; the last running replica takes its place."""
    k = cluster.model.num_nodes_per_dp
    last = cluster.replicas - 1
    for i in range(k):
        name = cluster.slots[replica * k + i]
        if name is not None:
            node = cluster.nodes[name]
            node.slot = None
            cluster.slots[replica * k + i] = None
            if not node.up or node.exited:
                node.cordoned = True
                cluster.to_repair(node)
    if replica != last:
        for i in range(k):
            moved = cluster.slots[last * k + i]
            cluster.slots[replica * k + i] = moved
            cluster.slots[last * k + i] = None
            if moved is not None:
                cluster.nodes[moved].slot = replica * k + i
    cluster.replicas -= 1


class SimulatedBackend(Backend):
    """Carries the supervisor's actions out on the simulated cluster."""

    name = "simulated"
    actions: ClassVar[ActionTable[SimulatedCluster]] = {
        ActionType.EMERGENCY_CHECKPOINT: emergency_checkpoint,
        ActionType.RESTART_IN_PLACE: restart_in_place,
        ActionType.RESTART_WORKLOAD: restart_workload,
        ActionType.HOT_SWAP: hot_swap,
        ActionType.SCALE_DOWN: scale_down,
        ActionType.SCALE_UP: scale_up,
        ActionType.CORDON: cordon,
        ActionType.UNCORDON: uncordon,
        ActionType.FORCE_DELETE_POD: force_delete_pod,
    }

    def __init__(self, cluster: SimulatedCluster) -> None:
        self.cluster = cluster
        self._done: dict[str, Mapping[str, Any]] = {}
        #: What the supervisor offers on start (the repair workflow requests through it).
        self.hooks: BackendHooks | None = None

    async def start(self, hooks: BackendHooks) -> None:
        self.hooks = hooks

    async def execute(self, action: ActionRecord) -> Mapping[str, Any]:
        done = self._done.get(action.idempotency_key)
        if done is not None:  # idempotent: a repeated call has the first call's effect
            return done
        result = await dispatch(self.name, self.actions, self.cluster, action)
        self._done[action.idempotency_key] = result
        return result

    def job_views(self) -> Mapping[str, JobView]:
        c = self.cluster
        view = JobView(
            name=c.job.name,
            num_dp_replicas=c.replicas,
            min_num_dp_replicas=c.model.min_num_dp_replicas or c.max_replicas,
            max_num_dp_replicas=c.max_replicas,
            num_nodes_per_dp=c.model.num_nodes_per_dp,
            nodes=tuple(sorted(n.name for n in c.job_nodes())),
        )
        return {c.job.name: view}

    def cluster_nodes(self) -> Mapping[str, ClusterNode]:
        return {
            n.name: ClusterNode(
                cordoned=n.cordoned, spare=n.slot is None and not n.in_repair and n.up
            )
            for n in self.cluster.nodes.values()
        }

"""What each simulated fault does to the simulated cluster (cluster.py): one handler per
`SimulatedFault` kind, in `SIMULATED_ACTS` (tests/test_fault_table.py checks that every
kind has one). A handler is called for a node that is up, with `in_job` true when the
node holds a slot of the job while it runs, starts or is stalled."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

from resiliency_protocol.faults import SimulatedFault
from resiliency_protocol.heartbeat import GPU_ECC, GPU_XID
from supervisor.sensor import GpuReport
from supervisor.simulate.fault_sources import Fault
from supervisor.simulate.hosts import SimNode

if TYPE_CHECKING:
    from supervisor.simulate.cluster import SimulatedCluster

#: Acts one fault out: (cluster, node, fault, now, in_job).
SimulatedAct = Callable[["SimulatedCluster", SimNode, Fault, float, bool], Awaitable[None]]


async def _node_down(
    cluster: SimulatedCluster, node: SimNode, fault: Fault, now: float, in_job: bool
) -> None:
    cluster.go_down(node, now)
    if in_job:
        cluster.stall(f"{node.name} down")


async def _network(
    cluster: SimulatedCluster, node: SimNode, fault: Fault, now: float, in_job: bool
) -> None:
    cluster.cut_off(node, now, float(fault.details.get("duration_s", 60.0)))
    if in_job:
        cluster.stall(f"{node.name} unreachable")


async def _gpu_xid(
    cluster: SimulatedCluster, node: SimNode, fault: Fault, now: float, in_job: bool
) -> None:
    code = int(fault.details.get("code", 79))
    report = GpuReport(kind=GPU_XID, gpu=_gpu(cluster, fault), code=code)
    await _gpu_error(cluster, node, fault, report, in_job)


async def _gpu_ecc(
    cluster: SimulatedCluster, node: SimNode, fault: Fault, now: float, in_job: bool
) -> None:
    count = int(fault.details.get("count", 1))
    report = GpuReport(kind=GPU_ECC, gpu=_gpu(cluster, fault), count=count)
    await _gpu_error(cluster, node, fault, report, in_job)


def _gpu(cluster: SimulatedCluster, fault: Fault) -> int:
    return int(fault.details.get("gpu", 0)) % cluster.model.gpus_per_node


async def _gpu_error(
    cluster: SimulatedCluster, node: SimNode, fault: Fault, report: GpuReport, in_job: bool
) -> None:
    if in_job:  # its workers die with it; the GPU report tells first
        cluster.stall(f"{fault.kind} on {node.name}")
    await cluster.report(node, gpu_reports=[report])


async def _worker_crash(
    cluster: SimulatedCluster, node: SimNode, fault: Fault, now: float, in_job: bool
) -> None:
    if in_job:
        cluster.stall(f"worker crash on {node.name}")
        node.exited = True
        await cluster.report(node, exit_code=int(fault.details.get("exit_code", 1)))


async def _worker_hang(
    cluster: SimulatedCluster, node: SimNode, fault: Fault, now: float, in_job: bool
) -> None:
    if in_job:
        cluster.stall(f"worker hang on {node.name}")


SIMULATED_ACTS: Mapping[SimulatedFault, SimulatedAct] = {
    SimulatedFault.NODE_DOWN: _node_down,
    SimulatedFault.NETWORK: _network,
    SimulatedFault.GPU_XID: _gpu_xid,
    SimulatedFault.GPU_ECC: _gpu_ecc,
    SimulatedFault.WORKER_CRASH: _worker_crash,
    SimulatedFault.WORKER_HANG: _worker_hang,
}

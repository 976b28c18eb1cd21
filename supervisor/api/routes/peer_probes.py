"""GET /api/v1/nodes/{node}/probe-targets: the peers a host monitor probes (agent
credential, its own node only), so that the sensor can tell a node cut off from its peers
(supervisor/sensor/peer_cuts.py)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, status

from resiliency_protocol.peer_probes import RING_NEIGHBOURS, ProbeTarget, ProbeTargets
from supervisor.api.deps import AgentDep, check_node
from supervisor.api.parts import Picture, Refusals

router = APIRouter(prefix="/api/v1/nodes", tags=["cluster"])


@router.get(
    "/{node}/probe-targets",
    response_model=ProbeTargets,
    summary="The peers a node's host monitor probes (its neighbours on a ring of live nodes)",
)
async def probe_targets(
    sensor: Picture, refusals: Refusals, agent: AgentDep, node: str
) -> ProbeTargets:
    check_node(refusals, agent, node, "node")
    if not sensor.has_node(node):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"node: {node!r} has sent no heartbeat")
    peers = sensor.probe_targets(node, RING_NEIGHBOURS)
    return ProbeTargets(peers=[ProbeTarget(node=name, url=url) for name, url in peers])

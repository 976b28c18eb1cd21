"""POST /api/v1/local/hosts: a host monitor started with `--launch` (on a host a scheduler
handed out) joins the supervisor's local cluster with the job it launched.

The host monitors' route (agent credential; the join names its node, refused with 403
unless that is the credential's). Only the local backend has a cluster to join: any other
answers 409. Idempotent: the same join again changes nothing; a host monitor started
again on its node joins with its new address (supervisor/local/hosts.py).
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from resiliency_protocol.errors import ErrorOut
from resiliency_protocol.launch import HostJoin, HostJoined
from supervisor.api.deps import AgentDep, check_node
from supervisor.api.parts import BackendDep, Picture, Refusals

router = APIRouter(prefix="/api/v1/local", tags=["cluster"])


@router.post(
    "/hosts",
    response_model=HostJoined,
    summary="A host that launched its node's workers joins the local cluster",
    responses={
        403: {
            "model": ErrorOut,
            "description": "The join names another node than the "
            "credential's; nothing was recorded.",
        },
        409: {
            "model": ErrorOut,
            "description": "The backend is not `local`, or the join "
            "contradicts the job (`message` names the field); nothing was recorded.",
        },
    },
)
async def join_host(
    backend: BackendDep, sensor: Picture, refusals: Refusals, agent: AgentDep, body: HostJoin
) -> HostJoined:
    check_node(refusals, agent, body.node, "node")
    from supervisor.local.backend import LocalBackend  # only local mode has hosts to join
    from supervisor.local.hosts import JoinConflict

    if not isinstance(backend, LocalBackend):
        raise HTTPException(409, f"backend: {backend.name!r} has no local cluster to join")
    try:
        joined = await backend.join_host(body)
    except JoinConflict as exc:
        raise HTTPException(409, str(exc)) from None
    finished = sensor.job_phase(body.job) == "finished"
    return HostJoined(**joined, finished=finished)

"""The peer checkpoint tier's routes on this node's own side (tier.py).

Workers (worker token, mounted by server.py):

    POST /v1/workers/{rank}/checkpoints/replicate    push a committed directory (202)
    GET  /v1/workers/{rank}/checkpoints/replicate    the newest push's state
    GET  /v1/workers/{rank}/checkpoints/peer         the partner's newest copy of the rank
    GET  /v1/workers/{rank}/checkpoints/channel      the data channel relaying its files
    POST /v1/workers/{rank}/checkpoints/fetch-peer   download it into the RAM tier

The actuator (actuator token): `GET`, `PUT` and `DELETE /v1/checkpoint-peer`, the partner.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, status
from fastapi import Path as PathParam

from host_monitor.peer.tier import PeerTier, PeerTierError
from resiliency_protocol.node_commands import CheckpointPeer
from resiliency_protocol.peer_checkpoints import (
    ChannelInfo,
    FetchPeerRequest,
    FetchPeerResult,
    PeerCopy,
    PeerTierStatus,
    ReplicateRequest,
    ReplicateStatus,
)

Rank = Annotated[int, PathParam(ge=0, description="Global rank of the worker.")]


def _http(exc: PeerTierError) -> HTTPException:
    return HTTPException(exc.status, str(exc))


def peer_worker_router(tier: PeerTier) -> APIRouter:
    router = APIRouter(prefix="/v1/workers", tags=["workers"])

    @router.post(
        "/{rank}/checkpoints/replicate",
        response_model=ReplicateStatus,
        status_code=status.HTTP_202_ACCEPTED,
        summary="Copy a committed RAM checkpoint to the partner node (in the background)",
    )
    async def replicate(rank: Rank, body: ReplicateRequest) -> ReplicateStatus:
        try:
            return tier.replicate(rank, body)
        except PeerTierError as exc:
            raise _http(exc) from None

    @router.get(
        "/{rank}/checkpoints/replicate",
        response_model=ReplicateStatus,
        summary="The state of the newest push asked for",
    )
    async def replicate_status(rank: Rank) -> ReplicateStatus:
        return tier.replicate_status(rank)

    @router.get(
        "/{rank}/checkpoints/peer",
        response_model=PeerCopy,
        summary="The partner's newest copy of this rank",
    )
    async def partner_copy(rank: Rank) -> PeerCopy:
        try:
            return await tier.partner_copy(rank)
        except PeerTierError as exc:
            raise _http(exc) from None

    @router.get(
        "/{rank}/checkpoints/channel",
        response_model=ChannelInfo,
        summary="Where this host monitor's data channel listens: files of the partner's "
        "copy are relayed there (op relay, worker token)",
    )
    async def channel(rank: Rank) -> ChannelInfo:
        return tier.channel_info(worker=True)

    @router.post(
        "/{rank}/checkpoints/fetch-peer",
        response_model=FetchPeerResult,
        summary="Download the partner's copy of this rank at a step into a RAM tier",
    )
    async def fetch_peer(rank: Rank, body: FetchPeerRequest) -> FetchPeerResult:
        try:
            return await tier.fetch(rank, body)
        except PeerTierError as exc:
            raise _http(exc) from None

    return router


def peer_actuator_router(tier: PeerTier) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["actuator"])

    @router.get(
        "/checkpoint-peer",
        response_model=PeerTierStatus,
        summary="The peer checkpoint tier: on or off, and the partner",
    )
    async def get_peer() -> PeerTierStatus:
        return tier.status()

    @router.put(
        "/checkpoint-peer",
        response_model=PeerTierStatus,
        summary="Set the partner node of the peer checkpoint tier",
    )
    async def put_peer(body: CheckpointPeer) -> PeerTierStatus:
        tier.node.checkpoint_peer = body
        return tier.status()

    @router.delete(
        "/checkpoint-peer", response_model=PeerTierStatus, summary="Forget the partner node"
    )
    async def delete_peer() -> PeerTierStatus:
        tier.node.checkpoint_peer = None
        return tier.status()

    return router

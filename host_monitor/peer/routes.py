"""Routes other host monitors call (peer token): the copies of their workers' checkpoints
this node keeps (store.py).

    PUT  /v1/peer/checkpoints/{job}/{rank}/{step}/files/{name}   raw body, streamed to disk
    POST /v1/peer/checkpoints/{job}/{rank}/{step}/commit         body: the manifest
    GET  /v1/peer/checkpoints/{job}/{rank}                       the newest copy, or 404
                                                                 (the older one kept within)
    GET  /v1/peer/checkpoints/{job}/{rank}/{step}/files/{name}   a file of it, streamed
    GET  /v1/peer/channel                                        the data channel's port

Files move over the data channel (channel.py) between host monitors that have it;
the file routes here serve partners that do not. `job` is `_` for a worker without a
job. With no peer_token set, every route answers 503.
"""

# No `from __future__ import annotations`: FastAPI must see the route-local `Store` type.
import asyncio
import os
import secrets
from collections.abc import AsyncIterator
from typing import Annotated, BinaryIO

from fastapi import APIRouter, Depends, HTTPException, Request, status
from fastapi import Path as PathParam
from fastapi.responses import StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from host_monitor.peer.files import CHUNK
from host_monitor.peer.store import (
    Full,
    Invalid,
    Mismatch,
    NotFound,
    PeerStore,
    PeerStoreError,
    Superseded,
    TooLarge,
)
from host_monitor.peer.tier import PeerTier
from resiliency_protocol.checkpoint_manifest import FILE_NAME_PATTERN, Manifest, check_file_name
from resiliency_protocol.checkpoint_reports import Tier
from resiliency_protocol.peer_checkpoints import (
    JOB_SEGMENT_PATTERN,
    ChannelInfo,
    CommitResult,
    PeerCopy,
    UploadedFile,
)

Job = Annotated[
    str, PathParam(pattern=JOB_SEGMENT_PATTERN, description="The job, or `_` for none.")
]
Rank = Annotated[int, PathParam(ge=0)]
Step = Annotated[int, PathParam(ge=0)]
FileName = Annotated[str, PathParam(pattern=FILE_NAME_PATTERN)]

_bearer = HTTPBearer(auto_error=False)


def _error(code: int, exc: PeerStoreError) -> HTTPException:
    return HTTPException(code, str(exc))


def peer_router(tier: PeerTier) -> APIRouter:
    def store_for_peer(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> PeerStore:
        if tier.store is None or tier.token is None:
            raise HTTPException(
                status.HTTP_503_SERVICE_UNAVAILABLE, "peer tier off: peer_token is not set"
            )
        if credentials is None or not secrets.compare_digest(
            credentials.credentials.encode(), tier.token.encode()
        ):
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "missing or invalid peer token",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return tier.store

    Store = Annotated[PeerStore, Depends(store_for_peer)]
    router = APIRouter(prefix="/v1/peer", tags=[Tier.PEER])

    @router.get(
        "/channel",
        response_model=ChannelInfo,
        summary="Where this host monitor's data channel listens (on its API's host)",
    )
    async def channel(store: Store) -> ChannelInfo:
        return tier.channel_info()

    def checked_name(name: str) -> str:
        try:
            return check_file_name(name)
        except ValueError as exc:
            raise HTTPException(422, f"name: {exc}") from None

    @router.put(
        "/checkpoints/{job}/{rank}/{step}/files/{name}",
        response_model=UploadedFile,
        summary="Upload one file of a copy (raw body)",
    )
    async def put_file(
        job: Job, rank: Rank, step: Step, name: FileName, request: Request, store: Store
    ) -> UploadedFile:
        name = checked_name(name)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > store.max_file_bytes:
            raise HTTPException(413, f"body: larger than {store.max_file_bytes} bytes")
        size_given = int(length) if length is not None and length.isdigit() else None
        try:
            store.check_upload(job, rank, size_given, None)
            size = await store.receive(job, rank, step, name, request.stream())
        except TooLarge as exc:
            raise _error(413, exc) from None
        except Full as exc:
            raise _error(507, exc) from None
        except Superseded as exc:
            raise _error(409, exc) from None
        return UploadedFile(name=name, size=size)

    @router.post(
        "/checkpoints/{job}/{rank}/{step}/commit",
        response_model=CommitResult,
        summary="Verify the uploaded files against the manifest and keep the copy",
    )
    async def commit(
        job: Job, rank: Rank, step: Step, manifest: Manifest, store: Store
    ) -> CommitResult:
        try:
            return await store.commit(job, rank, step, manifest)
        except (Mismatch, Superseded) as exc:  # Superseded: an older world's (StaleWorld)
            raise _error(409, exc) from None
        except Invalid as exc:
            raise _error(422, exc) from None

    @router.get(
        "/checkpoints/{job}/{rank}", response_model=PeerCopy, summary="The newest copy of a rank"
    )
    async def newest(job: Job, rank: Rank, store: Store) -> PeerCopy:
        copy = store.newest(job, rank)
        if copy is None:
            raise HTTPException(404, f"rank: no copy of rank {rank} of job {job}")
        return copy

    @router.get(
        "/checkpoints/{job}/{rank}/{step}/files/{name}",
        response_class=StreamingResponse,
        summary="A file of a committed copy, streamed",
    )
    async def get_file(
        job: Job, rank: Rank, step: Step, name: FileName, store: Store
    ) -> StreamingResponse:
        name = checked_name(name)
        try:
            fd, size = store.open_file(job, rank, step, name)
        except NotFound as exc:
            raise _error(404, exc) from None
        # A file object: closed when collected, should the response never start.
        return StreamingResponse(
            _stream(os.fdopen(fd, "rb"), size),
            media_type="application/octet-stream",
            headers={"Content-Length": str(size)},
        )

    return router


async def _stream(file: BinaryIO, size: int) -> AsyncIterator[bytes]:
    """The file from its start; closed at the end, or when the client goes away."""
    with file:
        offset = 0
        while offset < size:
            chunk = await asyncio.to_thread(
                os.pread, file.fileno(), min(CHUNK, size - offset), offset
            )
            if not chunk:
                break
            offset += len(chunk)
            yield chunk

"""Bodies of the peer checkpoint tier: host monitor to host monitor, and worker to its own
host monitor.

A committed checkpoint of one rank at one step is a directory of files plus its
manifest (checkpoint_manifest.py, written by the training side). The manifest travels
with a copy to the partner node, which verifies every file against it before it commits
the copy.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic import StringConstraints as Str

from resiliency_protocol.checkpoint_manifest import FileName, Manifest
from resiliency_protocol.node_commands import CheckpointPeer

# Path segment of a copy whose worker has no job.
NO_JOB = "_"
# A job as a path segment: a job name, or NO_JOB.
JOB_SEGMENT_PATTERN = r"^(_|[A-Za-z0-9][-A-Za-z0-9_.]{0,252})$"


# --- partner -> partner (peer token) ---------------------------------------------------


class PeerCopy(BaseModel):
    """GET /v1/peer/checkpoints/{job}/{rank}: the newest committed copy."""

    step: int
    manifest: Manifest
    older: list[PeerCopy] = Field(
        default_factory=list,
        description="The other copies of the rank kept (the save before the newest, of its "
        "world: ranks in lockstep can end one save apart), newest first; each one's files "
        "are fetched by its step as the newest's are.",
    )

    def by_step(self, step: int) -> PeerCopy | None:
        """This copy or the older one of `step`, if kept."""
        return next((c for c in (self, *self.older) if c.step == step), None)


class CommitResult(BaseModel):
    """POST /v1/peer/checkpoints/{job}/{rank}/{step}/commit"""

    step: int
    committed: bool = Field(
        description="False: the partner keeps a newer save of this rank (kept_step); this "
        "one was dropped."
    )
    kept_step: int = Field(description="The step the partner keeps for this rank now.")
    bytes: int


class UploadedFile(BaseModel):
    """PUT /v1/peer/checkpoints/{job}/{rank}/{step}/files/{name}: the file is in."""

    name: str
    size: int


class ChannelInfo(BaseModel):
    """GET /v1/peer/channel: where this host monitor's data channel listens."""

    port: int | None = Field(
        description="TCP port of the data channel on the host of this API's URL; null: no "
        "channel (files go over HTTP)."
    )
    tls: bool = Field(description="The channel speaks TLS, as the API does.")
    local: str | None = Field(
        None,
        description="To workers: a Unix socket under checkpoint_root that relays files too, "
        "handing the partner's connection itself to the worker when it is plain TCP (the "
        "bytes then cross no third process).",
    )


#: put, get: host monitor to host monitor (peer token). relay: a worker of this node asks
#: for a file of the partner's copy of its rank (worker token): its host monitor gets it
#: from the partner and passes the bytes on, so that they land in the worker's memory,
#: charged to the worker.
ChannelOp = Literal["put", "get", "relay"]


class ChannelRequest(BaseModel):
    """The header of a data channel connection (host_monitor/peer/wire.py): one file of one copy.

    Carries the peer token (the worker token for a relay; checked before any byte of the
    file is read) and what the
    file belongs to: the job, rank and step, and for an upload the save's world size and
    time, so that a save older than the copy kept is refused before its bytes move.
    """

    model_config = ConfigDict(extra="forbid")
    token: str = Field(max_length=4096, repr=False)
    op: ChannelOp
    job: Annotated[str, Str(pattern=JOB_SEGMENT_PATTERN)]
    rank: int = Field(ge=0)
    step: int = Field(ge=0)
    name: FileName
    size: int | None = Field(None, ge=0, description="put: the file's size.")
    checksum: Literal["crc32c", "crc32"] = "crc32c"
    world_size: int | None = Field(None, ge=1, description="put: of the save.")
    created: float | None = Field(None, description="put: the save's time (manifest).")
    world: int | None = Field(None, ge=0, description="put: the save's world (manifest).")


class ChannelReply(BaseModel):
    """The answer to a ChannelRequest (HTTP status codes), and for an upload the final
    answer once the bytes are in: their size and checksum."""

    status: int
    detail: str | None = None
    size: int | None = None
    checksum: int | None = None


# --- worker -> its host monitor (worker token) ------------------------------------------


class ReplicateRequest(BaseModel):
    """POST /v1/workers/{rank}/checkpoints/replicate"""

    model_config = ConfigDict(extra="forbid")
    step: int = Field(ge=0)
    path: str = Field(
        min_length=1,
        max_length=4096,
        description="The committed `.../step-<step:010d>/rank-<rank>` directory, under "
        "the host monitor's checkpoint_root.",
    )


PushState = Literal["queued", "running", "done", "failed"]


class ReplicateStatus(BaseModel):
    """GET /v1/workers/{rank}/checkpoints/replicate: the newest push asked for."""

    step: int | None = None
    state: PushState | None = None
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    replicated_step: int | None = Field(
        None, description="The newest step this host monitor pushed to the partner."
    )


class FetchPeerRequest(BaseModel):
    """POST /v1/workers/{rank}/checkpoints/fetch-peer"""

    model_config = ConfigDict(extra="forbid")
    step: int = Field(ge=0)
    dest: str = Field(
        min_length=1,
        max_length=4096,
        description="A tier root directory under checkpoint_root: the copy lands in "
        "<dest>/step-<step:010d>/rank-<rank>/.",
    )


class FetchPeerResult(BaseModel):
    step: int
    path: str
    bytes: int = Field(description="Bytes downloaded (0 when the directory was there).")
    seconds: float
    existed: bool = Field(
        False, description="A committed directory of that step was there: left alone."
    )


# --- actuator -> host monitor -------------------------------------------------------------


class PeerTierStatus(BaseModel):
    """GET /v1/checkpoint-peer"""

    enabled: bool = Field(description="False: peer_token not set, nothing is replicated.")
    peer: CheckpointPeer | None
    checkpoint_root: str
    peer_store_dir: str


JobSegment = Annotated[str, Str(pattern=JOB_SEGMENT_PATTERN)]

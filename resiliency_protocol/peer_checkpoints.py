"""Bodies of the peer checkpoint tier: host monitor to host monitor, and worker to its own
host monitor.

A committed checkpoint of one rank at one step is a directory of files plus
`manifest.json` (written by the training side): each file's size and checksum, CRC-32C
in format `resiliency-checkpoint/2`, zlib's crc32 in the older `resiliency-checkpoint/1`
(still read: checkpoints taken before an upgrade are still copied and served). The same
manifest travels with a copy to the partner node, which verifies every file against it
before it commits the copy.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Annotated, Any, Literal, Self

import crc32c
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)
from pydantic import StringConstraints as Str

from resiliency_protocol.node_commands import CheckpointPeer
from resiliency_protocol.states import Name

FORMAT = "resiliency-checkpoint/2"
Format = Literal["resiliency-checkpoint/2", "resiliency-checkpoint/1"]
#: Each format's checksum: the file entry's key, and the function (any buffer, running value).
Checksum = Callable[[Any, int], int]
CHECKSUMS: dict[str, tuple[str, Checksum]] = {
    FORMAT: ("crc32c", crc32c.crc32c),
    "resiliency-checkpoint/1": ("crc32", zlib.crc32),
}
CHECKSUM_BY_NAME: dict[str, Checksum] = {name: fn for name, fn in CHECKSUMS.values()}
MANIFEST = "manifest.json"
# Path segment of a copy whose worker has no job.
NO_JOB = "_"
FILE_NAME_PATTERN = r"^[A-Za-z0-9._-]{1,200}$"
# A job as a path segment: a job name, or NO_JOB.
JOB_SEGMENT_PATTERN = r"^(_|[A-Za-z0-9][-A-Za-z0-9_.]{0,252})$"
MAX_FILES = 100_000


def check_file_name(name: str) -> str:
    """A checkpoint file name: one path segment, never `.`, `..` or the manifest itself."""
    if name in (".", ".."):
        raise ValueError("must not be '.' or '..'")
    if name == MANIFEST:
        raise ValueError(f"{MANIFEST} is the manifest itself, not a listed file")
    return name


FileName = Annotated[str, Str(pattern=FILE_NAME_PATTERN), AfterValidator(check_file_name)]


class FileEntry(BaseModel):
    """A file's size and checksum: `crc32c` in format 2, `crc32` in format 1."""

    model_config = ConfigDict(extra="forbid")
    size: int = Field(ge=0)
    crc32c: int | None = Field(
        None, ge=0, le=0xFFFFFFFF, description="CRC-32C of the file's bytes (format 2)."
    )
    crc32: int | None = Field(
        None, ge=0, le=0xFFFFFFFF, description="zlib.crc32 of the file's bytes (format 1)."
    )

    @model_serializer(mode="wrap")
    def _without_the_other_sum(self, handler: SerializerFunctionWrapHandler) -> Any:
        body = handler(self)
        return {k: v for k, v in body.items() if v is not None or k == "size"}

    @property
    def checksum(self) -> int:
        return self.crc32c if self.crc32c is not None else (self.crc32 or 0)


class Manifest(BaseModel):
    """`manifest.json` of a committed checkpoint directory (rank `rank` at step `step`)."""

    model_config = ConfigDict(extra="forbid")
    format: Format
    step: int = Field(ge=0)
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    job: Name | None = None
    files: dict[FileName, FileEntry] = Field(max_length=MAX_FILES)
    created: float = Field(description="Unix time of the save.")
    world: int | None = Field(
        None,
        ge=0,
        description="The world (the job's attempt) the save was written in; absent: not "
        "known, older than every world.",
    )

    @model_serializer(mode="wrap")
    def _world_when_known(self, handler: SerializerFunctionWrapHandler) -> Any:
        # Left out when not known: as the training side writes it, and as a partner of a
        # version before worlds accepts it.
        body = handler(self)
        if isinstance(body, dict) and body.get("world") is None:
            body.pop("world", None)
        return body

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")
        key = CHECKSUMS[self.format][0]
        for name, entry in self.files.items():
            if getattr(entry, key) is None or (
                entry.crc32c is not None and entry.crc32 is not None
            ):
                raise ValueError(f"files.{name}: format {self.format} sums a file with {key} alone")
        return self

    @property
    def checksum(self) -> Checksum:
        return CHECKSUMS[self.format][1]

    @property
    def checksum_name(self) -> str:
        return CHECKSUMS[self.format][0]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def newer_than(self, other: Manifest) -> bool:
        """Whether this save comes after `other` (same job and rank): by world, then save
        time, then step. A job that went back to an older checkpoint saves lower steps
        later: those replace the copy of the abandoned run. A save of an older world
        never replaces a newer world's, whenever it was made (a node cut off)."""
        mine, theirs = _world(self.world), _world(other.world)
        return (mine, self.created, self.step) > (theirs, other.created, other.step)


def _world(world: int | None) -> int:
    return -1 if world is None else world


# --- partner -> partner (peer token) ---------------------------------------------------


class PeerCopy(BaseModel):
    """GET /v1/peer/checkpoints/{job}/{rank}: the newest committed copy."""

    step: int
    manifest: Manifest


class CommitResult(BaseModel):
    """POST /v1/peer/checkpoints/{job}/{rank}/{step}/commit"""

    step: int
    committed: bool = Field(
        description="False: the partner keeps a newer save of this rank (kept_step); this "
        "one was dropped."
    )
    kept_step: int = Field(description="The step the partner keeps for this rank now.")
    bytes: int


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

"""Bodies of the peer checkpoint tier: host monitor to host monitor, and worker to its own
host monitor.

A committed checkpoint of one rank at one step is a directory of files plus
`manifest.json` (written by the training side, format `resiliency-checkpoint/1`): each
file's size and zlib crc32. The same manifest travels with a copy to the partner node,
which verifies every file against it before it commits the copy.
"""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic import StringConstraints as Str

from host_monitor.protocol import CheckpointPeer
from host_monitor.wire import Name

FORMAT = "resiliency-checkpoint/1"
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
    model_config = ConfigDict(extra="forbid")
    size: int = Field(ge=0)
    crc32: int = Field(ge=0, le=0xFFFFFFFF, description="zlib.crc32 of the file's bytes.")


class Manifest(BaseModel):
    """`manifest.json` of a committed checkpoint directory (rank `rank` at step `step`)."""

    model_config = ConfigDict(extra="forbid")
    format: Literal["resiliency-checkpoint/1"]
    step: int = Field(ge=0)
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    job: Name | None = None
    files: dict[FileName, FileEntry] = Field(max_length=MAX_FILES)
    created: float = Field(description="Unix time of the save.")

    @model_validator(mode="after")
    def _rank_in_world(self) -> Self:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")
        return self

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def newer_than(self, other: Manifest) -> bool:
        """Whether this save comes after `other` (same job and rank): by save time, then
        step. A job that went back to an older checkpoint saves lower steps later: those
        replace the copy of the abandoned run."""
        return (self.created, self.step) > (other.created, other.step)


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

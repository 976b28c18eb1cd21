"""`manifest.json`, the one file that makes a checkpoint directory committed: declared
once here for every process that writes or reads it.

The training side writes it last into each rank's directory of each step (its RAM and
durable tiers: training/checkpoint/format.py, durable.py) and reads it back to restore;
the host monitor's peer tier copies a committed directory to the partner node with it
and verifies every file against it (host_monitor/peer/). Each file's size and checksum:
CRC-32C in format `resiliency-checkpoint/2`, zlib's crc32 in the older
`resiliency-checkpoint/1` (still read: checkpoints taken before an upgrade still restore
and are still copied). Imports nothing from supervisor, host_monitor or training.
"""

from __future__ import annotations

import json
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
    ValidationError,
    model_serializer,
    model_validator,
)
from pydantic import StringConstraints as Str

from resiliency_protocol.states import Name

#: The file's name in a committed directory (and the key's last segment in a bucket).
MANIFEST = "manifest.json"
Format = Literal["resiliency-checkpoint/2", "resiliency-checkpoint/1"]
FORMAT: Format = "resiliency-checkpoint/2"
#: Each format's checksum: the file entry's key, and the function (any buffer, running value).
Checksum = Callable[[Any, int], int]
CHECKSUMS: dict[str, tuple[str, Checksum]] = {
    FORMAT: ("crc32c", crc32c.crc32c),
    "resiliency-checkpoint/1": ("crc32", zlib.crc32),
}
CHECKSUM_BY_NAME: dict[str, Checksum] = {name: fn for name, fn in CHECKSUMS.values()}
FILE_NAME_PATTERN = r"^[A-Za-z0-9._-]{1,200}$"
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

    model_config = ConfigDict(extra="forbid", frozen=True)
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

    model_config = ConfigDict(extra="forbid", frozen=True)
    format: Format = FORMAT
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
        # Left out when not known: as a partner of a version before worlds accepts it.
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

    @classmethod
    def parse(cls, data: str | bytes) -> Manifest:
        """The manifest in `data`; ValueError naming the first field that is wrong."""
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            raise ValueError(f"{MANIFEST}: {first_error(exc)}") from None

    def to_json(self) -> str:
        """The file's text: keys sorted, as every version wrote it."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)

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


def first_error(exc: ValidationError) -> str:
    """`field: message` of a validation error's first problem."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "body"
    return f"{where}: {first['msg']}".replace("Value error, ", "")


def _world(world: int | None) -> int:
    return -1 if world is None else world

"""Files of the peer store and of checkpoint directories: names, checksums, manifests.

Shared by the store (store.py), which verifies what it received, and the tier
(tier.py), which reads what workers saved. Nothing here keeps state.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from pydantic import ValidationError

from resiliency_protocol.checkpoint_manifest import MANIFEST, Checksum, Manifest

CHUNK = 4 * 1024 * 1024  # bytes read or written at a time: memory stays flat
PART_PREFIX = "~"
MAX_MANIFEST_BYTES = 64 * 1024 * 1024

#: A received file's identity: (device, inode, size, mtime in ns). A file rewritten since
#: it was received has another, and is read again at its commit.
FileId = tuple[int, int, int, int]
#: Writes a file's bytes to the fd given: (size, checksum), in a thread.
Fill = Callable[[int], Awaitable[tuple[int, int]]]


def file_id(st: os.stat_result) -> FileId:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def step_dir_name(step: int) -> str:
    return f"step-{step:010d}"


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank}"


def parse_step(name: str) -> int | None:
    prefix, _, digits = name.partition("-")
    if prefix != "step" or len(digits) != 10 or not digits.isdigit():
        return None
    return int(digits)


def parse_rank(name: str) -> int | None:
    prefix, _, digits = name.partition("-")
    if prefix != "rank" or not digits.isdigit() or digits != str(int(digits)):
        return None
    return int(digits)


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def file_checksum(fd: int, checksum: Checksum) -> tuple[int, int]:
    """(size, checksum) of an open file, read in chunks from its start into one buffer."""
    size, crc = 0, 0
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    os.lseek(fd, 0, os.SEEK_SET)
    while n := os.readv(fd, [buffer]):
        size += n
        crc = checksum(view[:n], crc)
    return size, crc


def verify_files(
    directory: int, manifest: Manifest, known: dict[FileId, tuple[str, int]] | None = None
) -> tuple[str, str] | None:
    """(name, problem) of the first file of `directory` (a dir fd) that does not match the
    manifest; None when all do. Files the manifest does not list are removed.

    `known`: checksums computed as files were received, by file identity (the same bytes
    that were written); a file found there with the manifest's kind of sum is not read
    again."""
    listed = set(manifest.files)
    for name in os.listdir(directory):
        if name not in listed and not name.startswith(PART_PREFIX):
            os.unlink(name, dir_fd=directory)
    for name, entry in sorted(manifest.files.items()):
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
        except FileNotFoundError:
            return name, "not uploaded"
        try:
            st = os.fstat(fd)
            if st.st_size != entry.size:
                return name, f"size {st.st_size}, manifest says {entry.size}"
            sum_ = (known or {}).get(file_id(st))
            if sum_ is not None and sum_[0] == manifest.checksum_name:
                size, crc = st.st_size, sum_[1]
            else:
                size, crc = file_checksum(fd, manifest.checksum)
        finally:
            os.close(fd)
        if size != entry.size:
            return name, f"size {size}, manifest says {entry.size}"
        if crc != entry.checksum:
            return name, f"{manifest.checksum_name} {crc}, manifest says {entry.checksum}"
    return None


def read_manifest(directory: Path) -> Manifest | None:
    try:
        with (directory / MANIFEST).open("rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError:
        return None
    try:
        return Manifest.model_validate_json(data)
    except ValidationError:
        return None

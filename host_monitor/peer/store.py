"""The copies of a partner's checkpoints this node keeps: files in, verified commit, files out.

Layout under the store directory:

    <job or _>/rank-<rank>/step-<step:010d>/   committed copies (files + manifest.json)
    .incoming/<job or _>/rank-<rank>/step-<step:010d>/   uploads not committed yet
    .trash/   what is being deleted

An uploaded file is written to a part file (`~<hex>.part`: `~` is in no checkpoint file
name) and renamed to its name once complete. A commit verifies every file of the
manifest (size and checksum, streamed), writes `manifest.json`, renames the upload
directory into place, and then deletes every other copy of that rank but the save before
it in its world (retention.py: ranks in lockstep can end one save apart). Copies of other
jobs, and of ranks the new copy's world size no longer has, go too: a node holds its
partner's two newest shards, nothing older.

Commits of one (job, rank) are serialized; a commit of an older save than the one kept
(uploads of two steps overlapping) is dropped. Uploads and commits of an older world than
the job's newest seen here are refused (worlds.py). Leftovers of a crash (uploads, trash,
older copies) are removed at start. Nothing here knows about HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from host_monitor.errors import HostMonitorError
from host_monitor.peer.files import (
    CHUNK,
    PART_PREFIX,
    FileId,
    Fill,
    file_id,
    parse_rank,
    parse_step,
    rank_dir_name,
    step_dir_name,
    verify_files,
    write_all,
)
from host_monitor.peer.retention import Kept, committed, to_keep
from resiliency_protocol.checkpoint_manifest import CHECKSUMS, FORMAT, MANIFEST, Checksum, Manifest
from resiliency_protocol.peer_checkpoints import CommitResult, PeerCopy

if TYPE_CHECKING:
    from host_monitor.peer.worlds import PeerWorlds

log = logging.getLogger(__name__)

INCOMING = ".incoming"
TRASH = ".trash"
# Checksums of received files kept for their commit, by file identity: a bound on what a
# sender that never commits can leave behind.
MAX_SUMS = 100_000


class PeerStoreError(HostMonitorError):
    """A request the store refuses: `field` names what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class Invalid(PeerStoreError):
    pass


class NotFound(PeerStoreError):
    pass


class TooLarge(PeerStoreError):
    pass


class Mismatch(PeerStoreError):
    """A file of the upload is missing or does not match the manifest: nothing committed."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"files.{name}", message)
        self.name = name


class Superseded(PeerStoreError):
    """The upload's directory was removed, or a newer save of the rank is kept."""


class StaleWorld(Superseded):
    """The save is of an older world than the job's newest seen here (worlds.py)."""


class Full(PeerStoreError):
    """The file would take the store over its `max_bytes`."""


class PeerStore:
    def __init__(
        self,
        root: Path,
        *,
        max_file_bytes: int,
        max_bytes: int | None = None,
        worlds: PeerWorlds | None = None,
    ) -> None:
        """`worlds`: refuse saves of an older world than the job's newest (none: no fence)."""
        self.root = root
        self.worlds = worlds
        self.max_file_bytes = max_file_bytes
        self.max_bytes = max_bytes
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        # Uploads being received now, by (job, rank, step): a commit leaves them alone.
        self._receiving: dict[tuple[str, int, int], int] = {}
        self._reserved = 0  # bytes of the uploads being received
        self._sums: OrderedDict[FileId, tuple[str, int]] = OrderedDict()
        self._removals: set[asyncio.Task[None]] = set()

    # --- layout -------------------------------------------------------------------------

    def _rank_dir(self, job: str, rank: int) -> Path:
        return self.root / job / rank_dir_name(rank)

    def _upload_dir(self, job: str, rank: int, step: int) -> Path:
        return self.root / INCOMING / job / rank_dir_name(rank) / step_dir_name(step)

    def _lock(self, job: str, rank: int) -> asyncio.Lock:
        return self._locks.setdefault((job, rank), asyncio.Lock())

    # --- start ----------------------------------------------------------------------------

    def start(self) -> None:
        """Create the store; remove what a crash left: uploads, trash, superseded copies."""
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in (INCOMING, TRASH):
            shutil.rmtree(self.root / leftover, ignore_errors=True)
        kept = 0
        for job_dir in self._job_dirs():
            for rank_dir in job_dir.iterdir():
                if parse_rank(rank_dir.name) is None:
                    continue
                copies = committed(rank_dir)
                if copies and self.worlds is not None:
                    self.worlds.seen(job_dir.name, copies[0].manifest.world)
                keep = {c.path.name for c in to_keep(copies, self._room_beside(copies))}
                for entry in rank_dir.iterdir():
                    if entry.name not in keep:
                        _remove(entry)
                kept += len(keep)
        log.info("peer store %s: %d copies kept from before", self.root, kept)

    def _job_dirs(self) -> list[Path]:
        return [p for p in self.root.iterdir() if not p.name.startswith(".") and p.is_dir()]

    # --- reads --------------------------------------------------------------------------

    def _scan(self, rank_dir: Path) -> Kept | None:
        """The newest committed copy in `rank_dir`."""
        return next(iter(committed(rank_dir)), None)

    def _room_beside(self, copies: list[Kept]) -> Callable[[Kept], bool]:
        """Whether the store's cap leaves room for an older copy beside the newest of
        `copies` (a rank's, newest first) and the next copy of its size as it arrives."""

        def room_for(older: Kept) -> bool:
            if self.max_bytes is None:
                return True
            others = self.used_bytes() - sum(c.manifest.total_bytes for c in copies)
            newest = copies[0].manifest.total_bytes
            return others + 2 * newest + older.manifest.total_bytes <= self.max_bytes

        return room_for

    def newest(self, job: str, rank: int) -> PeerCopy | None:
        """The newest copy of (job, rank), with the older one kept (retention.py)."""
        kept = committed(self._rank_dir(job, rank))
        copies = [PeerCopy(step=c.step, manifest=c.manifest) for c in kept]
        return copies[0].model_copy(update={"older": copies[1:]}) if copies else None

    def open_file(self, job: str, rank: int, step: int, name: str) -> tuple[int, int]:
        """(fd, size) of a file of the committed copy; opened now, so deleting the copy
        (a newer one committed) does not cut a download short. The caller closes fd."""
        directory = self._rank_dir(job, rank) / step_dir_name(step)
        if not (directory / MANIFEST).is_file():
            raise NotFound("step", f"no copy of rank {rank} of job {job} at step {step}")
        try:
            fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound("name", f"no file {name!r} in the copy of step {step}") from None
        return fd, os.fstat(fd).st_size

    # --- uploads --------------------------------------------------------------------------

    def check_upload(
        self,
        job: str,
        rank: int,
        size: int | None,
        created: float | None,
        world: int | None = None,
        step: int = 0,
    ) -> None:
        """Refuse an upload before its bytes move: TooLarge, Full, Superseded when the
        copy kept of (job, rank) is of a newer save than `created`, StaleWorld when
        `world` is older than the job's newest (None: not told, checked at the commit)."""
        if world is not None and self.worlds is not None:
            self.worlds.check(job, rank, step, world, "upload")
        if size is not None and size > self.max_file_bytes:
            raise TooLarge("size", f"larger than {self.max_file_bytes} bytes")
        if size is not None and self.max_bytes is not None:
            used = self.used_bytes() + self._reserved
            if used + size > self.max_bytes:
                raise Full(
                    "size",
                    f"{size} bytes do not fit: {used} of the store's {self.max_bytes} are used",
                )
        if created is not None:
            kept = self._scan(self._rank_dir(job, rank))
            if kept is not None and kept.manifest.created > created:
                raise Superseded("step", f"a newer save (step {kept.step}) of the rank is kept")

    def used_bytes(self) -> int:
        """Bytes of every file in the store: copies, uploads, trash."""
        total = 0
        for directory, _, files in os.walk(self.root):
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    total += os.stat(os.path.join(directory, name), follow_symlinks=False).st_size
        return total

    async def receive(
        self, job: str, rank: int, step: int, name: str, chunks: AsyncIterable[bytes]
    ) -> int:
        """Write one uploaded file (an HTTP body); returns its size. It appears under its
        name only once complete."""
        checksum = CHECKSUMS[FORMAT][1]

        async def fill(fd: int) -> tuple[int, int]:
            size, crc = 0, 0
            buffer = bytearray()
            async for chunk in chunks:
                size += len(chunk)
                if size > self.max_file_bytes:
                    raise TooLarge("body", f"larger than {self.max_file_bytes} bytes")
                buffer += chunk
                if len(buffer) >= CHUNK:
                    # A thread: a write to a disk-backed store must not stall the loop.
                    crc = await asyncio.to_thread(_write_summed, fd, buffer, checksum, crc)
                    buffer.clear()
            if buffer:
                crc = await asyncio.to_thread(_write_summed, fd, buffer, checksum, crc)
            return size, crc

        size, _ = await self.receive_with(job, rank, step, name, fill, CHECKSUMS[FORMAT][0])
        return size

    async def receive_with(
        self,
        job: str,
        rank: int,
        step: int,
        name: str,
        fill: Fill,
        checksum_name: str,
        reserve: int = 0,
    ) -> tuple[int, int]:
        """Write one uploaded file with `fill`, which returns (size, checksum of kind
        `checksum_name`); the checksum is kept for the commit. `reserve`: the bytes it
        will take, counted against max_bytes meanwhile."""
        key = (job, rank, step)
        self._receiving[key] = self._receiving.get(key, 0) + 1
        self._reserved += reserve
        try:
            return await self._receive(job, rank, step, name, fill, checksum_name)
        finally:
            self._reserved -= reserve
            self._receiving[key] -= 1
            if not self._receiving[key]:
                del self._receiving[key]

    async def _receive(
        self, job: str, rank: int, step: int, name: str, fill: Fill, checksum_name: str
    ) -> tuple[int, int]:
        directory = self._upload_dir(job, rank, step)
        directory.mkdir(parents=True, exist_ok=True)
        part = directory / f"{PART_PREFIX}{uuid.uuid4().hex}.part"
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                size, crc = await fill(fd)
                identity = file_id(os.fstat(fd))
            finally:
                os.close(fd)
            os.replace(part, directory / name)
        except FileNotFoundError:
            raise Superseded("step", "this upload was dropped: its job left") from None
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        self._sums[identity] = (checksum_name, crc)
        while len(self._sums) > MAX_SUMS:
            self._sums.popitem(last=False)
        return size, crc

    async def commit(self, job: str, rank: int, step: int, manifest: Manifest) -> CommitResult:
        """Verify the upload against `manifest`, then make it the copy of (job, rank).

        Raises Mismatch (the bad file is removed, the rest of the upload stays for a
        retry). An older save than the one kept is dropped: `committed` False.
        """
        for field, ours, theirs in (("step", step, manifest.step), ("rank", rank, manifest.rank)):
            if ours != theirs:
                raise Invalid(f"manifest.{field}", f"is {theirs}, the path says {ours}")
        if manifest.job is not None and manifest.job != job:
            raise Invalid("manifest.job", f"is {manifest.job!r}, the path says {job!r}")
        async with self._lock(job, rank):
            rank_dir = self._rank_dir(job, rank)
            upload = self._upload_dir(job, rank, step)
            if self.worlds is not None:
                try:
                    self.worlds.check(job, rank, step, manifest.world, "commit")
                except StaleWorld:
                    await self._discard(upload)
                    raise
            kept = self._scan(rank_dir)
            if kept is not None and kept.manifest.newer_than(manifest):
                log.info(
                    "peer copy of %s rank %d step %d dropped: step %d is newer",
                    job,
                    rank,
                    step,
                    kept.step,
                )
                await self._discard(upload)
                return CommitResult(
                    step=step, committed=False, kept_step=kept.step, bytes=manifest.total_bytes
                )
            if kept is not None and kept.step == step and kept.manifest == manifest:
                await self._discard(upload)  # committed before (a retry): nothing new
                return CommitResult(
                    step=step, committed=True, kept_step=step, bytes=manifest.total_bytes
                )
            if not manifest.files:
                upload.mkdir(parents=True, exist_ok=True)  # nothing was uploaded: no directory
            try:
                dir_fd = os.open(upload, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                first = min(manifest.files, default=MANIFEST)
                raise Mismatch(first, "not uploaded") from None
            try:
                problem = await asyncio.to_thread(verify_files, dir_fd, manifest, self._sums)
                if problem is not None:
                    name, message = problem
                    # Removed so that a retry uploads it again rather than trusting it.
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=dir_fd)
                    raise Mismatch(name, message)
                _write_manifest(dir_fd, manifest)
            finally:
                os.close(dir_fd)
            final = rank_dir / step_dir_name(step)
            rank_dir.mkdir(parents=True, exist_ok=True)
            # No await from here to the end of the renames: no request sees a half state.
            doomed = [self._to_trash(final)] if final.exists() else []
            os.rename(upload, final)
            copies = committed(rank_dir)
            keep = {c.path.name for c in to_keep(copies, self._room_beside(copies))}
            for entry in list(rank_dir.iterdir()):
                if entry.name not in keep | {final.name}:
                    doomed.append(self._to_trash(entry))
            doomed.extend(self._superseded_by(job, rank, step, manifest))
            if self.worlds is not None:
                self.worlds.seen(job, manifest.world)
        log.info(
            "peer copy of %s rank %d step %d committed (%d files, %d bytes)",
            job,
            rank,
            step,
            len(manifest.files),
            manifest.total_bytes,
        )
        # In the background: freeing a copy of many GB takes a while, and the sender need
        # not wait for it (what is in the trash still counts against max_bytes).
        removal = asyncio.create_task(asyncio.to_thread(_remove_all, doomed))
        self._removals.add(removal)
        removal.add_done_callback(self._removals.discard)
        return CommitResult(step=step, committed=True, kept_step=step, bytes=manifest.total_bytes)

    async def close(self) -> None:
        """Wait for the copies being removed."""
        await asyncio.gather(*self._removals, return_exceptions=True)

    def _superseded_by(self, job: str, rank: int, step: int, manifest: Manifest) -> list[Path]:
        """Into the trash: uploads of this rank no request is writing (left by a sender
        that gave up), copies and uploads of other jobs, and of ranks outside the new
        copy's world size."""
        doomed: list[Path] = []
        upload_ranks = self.root / INCOMING / job / rank_dir_name(rank)
        if upload_ranks.is_dir():
            for entry in upload_ranks.iterdir():
                other = parse_step(entry.name)
                if other is not None and (job, rank, other) not in self._receiving:
                    doomed.append(self._to_trash(entry))
        for base in (self.root, self.root / INCOMING):
            if not base.is_dir():
                continue
            for job_dir in base.iterdir():
                if job_dir.name.startswith(".") or not job_dir.is_dir():
                    continue
                if job_dir.name != job:
                    doomed.append(self._to_trash(job_dir))
                    continue
                for rank_dir in job_dir.iterdir():
                    other_rank = parse_rank(rank_dir.name)
                    if other_rank is not None and other_rank >= manifest.world_size:
                        doomed.append(self._to_trash(rank_dir))
        return doomed

    def _to_trash(self, path: Path) -> Path:
        trash = self.root / TRASH
        trash.mkdir(exist_ok=True)
        target = trash / uuid.uuid4().hex
        os.rename(path, target)
        return target

    async def _discard(self, upload: Path) -> None:
        try:
            doomed = self._to_trash(upload)
        except FileNotFoundError:
            return
        await asyncio.to_thread(_remove, doomed)


def _write_manifest(dir_fd: int, manifest: Manifest) -> None:
    data = json.dumps(manifest.model_dump(mode="json"), indent=1).encode()
    fd = os.open(
        MANIFEST,
        os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o644,
        dir_fd=dir_fd,
    )
    try:
        write_all(fd, data)
    finally:
        os.close(fd)


def _write_summed(fd: int, data: bytearray, checksum: Checksum, crc: int) -> int:
    write_all(fd, data)
    return checksum(data, crc)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove_all(paths: list[Path]) -> None:
    for path in paths:
        _remove(path)

"""The on-disk format of the checkpoint tiers: one committed directory per rank and step.

    <tier root>/step-<step:010d>/rank-<rank>/
        manifest.json                 written last, inside the temporary directory
        .metadata, __0_0.distcp, ...  what torch.distributed.checkpoint wrote

`manifest.json` is the protocol's `Manifest` (resiliency_protocol/checkpoint_manifest.py):
format, step, rank, world_size, job, each file's size and checksum, the save's time and
`world`, the job's attempt the commit was written in (fencing.py says what it fences).
A directory is written under a hidden temporary name beside its final one and renamed
into place once every file and the manifest are on disk (fsynced), so a process killed
mid-save never leaves a directory that looks complete. A reader trusts a directory only
when its manifest parses, names the same step and rank as its path, and every listed
file has its size; `verify` then streams each file through its checksum (a few MiB at a
time, never the whole file in memory) before it is loaded.

The checksum is CRC-32C (Castagnoli), summed with the CPU's crc32 instruction by the
`crc32c` library: about 10 GB/s a core here against 3.7 for zlib's crc32, so summing the
bytes as they are written or read costs a tenth of a RAM tier's rate, not a third; it is
also the checksum cloud buckets keep per object. Format `resiliency-checkpoint/1`, which
summed with zlib's crc32, is still read, so that checkpoints taken before an upgrade
restore.

In a bucket (durable.py) the same layout is a set of objects with no rename: there a
rank's step is committed when its manifest object, uploaded last, exists.

The host monitor reads the same layout when it copies a rank's newest checkpoint to its
partner node (the peer tier).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import crc32c

from resiliency_protocol.checkpoint_manifest import MANIFEST, Checksum, FileEntry, Manifest
from training.errors import TrainingError

_CHUNK = 8 * 1024 * 1024
_STEP_RE = re.compile(r"^step-(\d{10,})$")
_RANK_RE = re.compile(r"^rank-(\d+)$")
TMP_PREFIX = ".tmp-"


class CheckpointCorrupt(TrainingError):
    """A checkpoint directory failed verification (the message names the file)."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:010d}"


def rank_dir(root: Path, step: int, rank: int) -> Path:
    return step_dir(root, step) / f"rank-{rank}"


def file_checksum(path: Path, checksum: Checksum = crc32c.crc32c) -> int:
    """The checksum of a file, streamed through one reused buffer (never the whole file)."""
    crc = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = checksum(view[:n], crc)
    return crc


def build_manifest(
    directory: Path,
    *,
    step: int,
    rank: int,
    world_size: int,
    job: str | None,
    threads: int = 1,
    known: Mapping[str, tuple[int, int]] | None = None,
    world: int | None = None,
) -> Manifest:
    """Checksum every file of `directory` (the manifest itself excluded), `threads` files
    at a time (crc32c releases the GIL while it sums a large buffer). `known`: (size,
    crc32c) by name, summed as the files were written; taken where the size on disk
    agrees, so those files are not read again."""
    names = [
        name
        for name in sorted(os.listdir(directory))
        if name != MANIFEST and (directory / name).is_file()
    ]
    sizes = {name: (directory / name).stat().st_size for name in names}
    summed = {
        name: entry[1]
        for name, entry in (known or {}).items()
        if name in sizes and entry[0] == sizes[name]
    }
    left = [name for name in names if name not in summed]
    with ThreadPoolExecutor(max(1, min(threads, len(left) or 1))) as pool:
        crcs = list(pool.map(file_checksum, (directory / name for name in left)))
    summed.update(zip(left, crcs, strict=True))
    files = {name: FileEntry(size=sizes[name], crc32c=summed[name]) for name in names}
    return Manifest(
        step=step,
        rank=rank,
        world_size=world_size,
        job=job,
        files=files,
        created=time.time(),
        world=world,
    )


def read_manifest(directory: Path, *, step: int | None = None, rank: int | None = None) -> Manifest:
    """The manifest of a committed directory, checked against its path and file sizes
    (cheap: no file is read). Raises CheckpointCorrupt."""
    try:
        manifest = Manifest.parse((directory / MANIFEST).read_bytes())
    except OSError as exc:
        raise CheckpointCorrupt(f"{directory}: no manifest ({exc.strerror})") from None
    except ValueError as exc:
        raise CheckpointCorrupt(f"{directory}: {exc}") from None
    if (step is not None and manifest.step != step) or (rank is not None and manifest.rank != rank):
        raise CheckpointCorrupt(
            f"{directory}: manifest names step {manifest.step} rank {manifest.rank}"
        )
    for name, entry in manifest.files.items():
        try:
            size = (directory / name).stat().st_size
        except OSError:
            raise CheckpointCorrupt(f"{directory / name}: missing") from None
        if size != entry.size:
            raise CheckpointCorrupt(f"{directory / name}: {size} bytes, manifest says {entry.size}")
    return manifest


def verify(
    directory: Path,
    manifest: Manifest,
    *,
    threads: int = 1,
    names: Iterable[str] | None = None,
) -> None:
    """Stream every file (or those of `names`) through the manifest's checksum, `threads`
    files at a time, and compare with the manifest."""
    names = list(manifest.files if names is None else names)

    def crc_of(name: str) -> int | OSError:
        try:
            return file_checksum(directory / name, manifest.checksum)
        except OSError as exc:
            return exc

    with ThreadPoolExecutor(max(1, min(threads, len(names) or 1))) as pool:
        crcs = list(pool.map(crc_of, names))
    for name, crc in zip(names, crcs, strict=True):
        path, entry = directory / name, manifest.files[name]
        if isinstance(crc, OSError):
            raise CheckpointCorrupt(f"{path}: {crc.strerror}")
        if crc != entry.checksum:
            raise CheckpointCorrupt(
                f"{path}: checksum {crc:#010x}, manifest says {entry.checksum:#010x}"
            )


def new_temp_dir(root: Path, step: int, rank: int) -> Path:
    """A fresh hidden directory beside where `rank_dir(root, step, rank)` will be."""
    parent = step_dir(root, step)
    parent.mkdir(parents=True, exist_ok=True)
    path = parent / f"{TMP_PREFIX}rank-{rank}-{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def commit(temp: Path, manifest: Manifest, final: Path, *, sync: bool = True) -> None:
    """Write the manifest into `temp`, then rename `temp` to `final` atomically.

    A committed directory of the same step and rank (a run that went further before it
    was rolled back) is moved aside first and removed after: between the two renames
    neither counts, which is safe (the step is simply not there for a moment).
    """
    with open(temp / MANIFEST, "w", encoding="utf-8") as f:
        f.write(manifest.to_json())
        if sync:
            f.flush()
            os.fsync(f.fileno())
    if sync:
        for name in manifest.files:
            fsync_path(temp / name)
        fsync_path(temp)
    old: Path | None = None
    if final.exists():
        old = final.parent / f"{TMP_PREFIX}old-{final.name}-{secrets.token_hex(4)}"
        os.replace(final, old)
    os.replace(temp, final)
    if sync:
        fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def copy_committed(
    source: Path, manifest: Manifest, root: Path, *, sync: bool = True, threads: int = 1
) -> Path:
    """Copy a committed rank directory into another tier root (durable), atomically,
    `threads` files at a time (the copy runs in the kernel, without the GIL)."""
    temp = new_temp_dir(root, manifest.step, manifest.rank)
    try:

        def copy(name: str) -> None:
            shutil.copyfile(source / name, temp / name)
            if sync:
                fsync_path(temp / name)  # in this thread: the files flush in parallel

        with ThreadPoolExecutor(max(1, min(threads, len(manifest.files) or 1))) as pool:
            list(pool.map(copy, manifest.files))
        final = rank_dir(root, manifest.step, manifest.rank)
        commit(temp, manifest, final, sync=sync)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return final


def committed_steps(root: Path, rank: int) -> list[int]:
    """Steps with a committed directory for `rank` under `root`, ascending (sizes not
    checked yet: see `read_manifest`)."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    steps = []
    for name in names:
        match = _STEP_RE.match(name)
        if match and (Path(root) / name / f"rank-{rank}" / MANIFEST).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def committed_ranks(root: Path) -> list[int]:
    """Ranks with at least one committed directory under `root`, ascending."""
    ranks: set[int] = set()
    try:
        names = os.listdir(root)
    except OSError:
        return []
    for name in names:
        if not _STEP_RE.match(name):
            continue
        with contextlib.suppress(OSError):
            for child in os.listdir(Path(root) / name):
                match = _RANK_RE.match(child)
                if match and (Path(root) / name / child / MANIFEST).is_file():
                    ranks.add(int(match.group(1)))
    return sorted(ranks)


def remove_step(root: Path, step: int, rank: int) -> None:
    shutil.rmtree(rank_dir(root, step, rank), ignore_errors=True)
    parent = step_dir(root, step)
    with contextlib.suppress(OSError):
        if not any(_RANK_RE.match(child) for child in os.listdir(parent)):
            # The step's global metadata (global_view.publish) names files now gone.
            for child in os.listdir(parent):
                if child == ".metadata" or child.startswith(f"{TMP_PREFIX}.metadata"):
                    (parent / child).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        parent.rmdir()  # only when no other rank's directory is left


def beyond_retention(steps: Iterable[int], keep: int, aside: Iterable[int] = ()) -> list[int]:
    """Which of `steps` retention removes: all but the newest `keep` of those not `aside`.
    Steps `aside` (emergency saves) do not count: each stays while it is newer than the
    oldest step kept, so that an emergency save never pushes out the periodic step that a
    rank which could not save it (the failed one) shares with the others."""
    extra = set(aside)
    regular = sorted(s for s in steps if s not in extra)
    kept = regular[max(0, len(regular) - keep) :]
    oldest = kept[0] if kept else None
    return sorted(
        s for s in steps if s not in kept and not (s in extra and (oldest is None or s > oldest))
    )


def retain(
    root: Path, rank: int, keep: int, *, protect: Iterable[int] = (), aside: Iterable[int] = ()
) -> list[int]:
    """Remove all but the newest `keep` committed steps of `rank` (`aside`: emergency
    saves, see `beyond_retention`); returns those removed. Steps in `protect` (being
    copied elsewhere) stay."""
    protected = set(protect)
    removed = [
        s for s in beyond_retention(committed_steps(root, rank), keep, aside) if s not in protected
    ]
    for step in removed:
        remove_step(root, step, rank)
    return removed


def remove_temporaries(root: Path, rank: int) -> None:
    """Remove this rank's leftovers of saves cut short (a kill -9 mid-save)."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if not _STEP_RE.match(name):
            continue
        parent = Path(root) / name
        with contextlib.suppress(OSError):
            for child in os.listdir(parent):
                if child.startswith(f"{TMP_PREFIX}rank-{rank}-") or (
                    child.startswith(f"{TMP_PREFIX}old-rank-{rank}-")
                ):
                    shutil.rmtree(parent / child, ignore_errors=True)
        with contextlib.suppress(OSError):
            parent.rmdir()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory; errors ignored (not every file system supports it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

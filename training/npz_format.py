"""The NumPy workload's on-disk checkpoint file: one shard of one step, verified on read.

Standard library only, so that finding and verifying a checkpoint needs no numpy.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import secrets
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from training.checkpoint.format import fsync_path

__all__ = [
    "CHECKPOINT_META",
    "CheckpointData",
    "checkpoint_file",
    "checkpoint_steps",
    "list_checkpoints",
    "newest_checkpoint",
    "read_checkpoint",
    "step_dir",
    "write_checkpoint_file",
]

# --- on-disk checkpoint layout ---------------------------------------------------------
#
#   <tier_dir>/step-<step:08d>/shard-<k>-of-<N>.npz
#
# Each file is a zip archive (readable by `numpy.load` as an .npz): one `<name>.npy`
# member per array, stored uncompressed, plus `meta.json` = {"format": 1, "step",
# "shard", "num_shards", "sha256": {member: hex digest}, "world"}. `world` is the world the
# file was written in (training/checkpoint/fencing.py); it is absent when the writer knew
# none, and in files written before it was recorded: such a file counts as older than
# every world. A file is complete only if it
# has its final name (it is written under a hidden temporary name in the same directory,
# flushed, fsynced, renamed with os.replace, and the directory fsynced), its zip CRCs
# check, its metadata names the same step and shard as its path, and every member's
# sha256 matches. Temporary files never match the final name pattern.

CHECKPOINT_META = "meta.json"
_FORMAT = 1
_STEP_DIR_RE = re.compile(r"^step-(\d{8,})$")


def step_dir(tier_dir: Path, step: int) -> Path:
    return Path(tier_dir) / f"step-{step:08d}"


def checkpoint_file(tier_dir: Path, step: int, shard: int, num_shards: int) -> Path:
    return step_dir(tier_dir, step) / f"shard-{shard}-of-{num_shards}.npz"


def checkpoint_steps(tier_dir: Path) -> list[int]:
    """Steps that have a directory in `tier_dir` (complete or not), ascending."""
    try:
        names = os.listdir(tier_dir)
    except OSError:
        return []
    steps = []
    for name in names:
        match = _STEP_DIR_RE.match(name)
        if match:
            steps.append(int(match.group(1)))
    return sorted(steps)


@dataclass(frozen=True)
class CheckpointData:
    """A verified checkpoint file: its metadata and the raw bytes of each member."""

    path: Path
    step: int
    shard: int
    num_shards: int
    members: dict[str, bytes]  # "<name>.npy" -> bytes, meta.json excluded
    world: int | None = None  # None: written in no known world


def write_checkpoint_file(
    tier_dir: Path,
    step: int,
    shard: int,
    num_shards: int,
    members: Mapping[str, bytes],
    *,
    world: int | None = None,
) -> Path:
    """Write one shard's checkpoint atomically; returns its path.

    `members` maps member names (e.g. "w.npy") to their bytes; `world`, the world it is
    written in (None: not recorded). Safe when several
    processes write the same file at once: each writes its own temporary file and the
    last rename wins, and every version is complete.
    """
    if CHECKPOINT_META in members:
        raise ValueError(f"{CHECKPOINT_META} is reserved")
    final = checkpoint_file(tier_dir, step, shard, num_shards)
    final.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": _FORMAT,
        "step": step,
        "shard": shard,
        "num_shards": num_shards,
        "sha256": {name: hashlib.sha256(data).hexdigest() for name, data in members.items()},
    }
    if world is not None:
        meta["world"] = world
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(tmp, "wb") as raw:
            with zipfile.ZipFile(raw, "w", compression=zipfile.ZIP_STORED) as archive:
                for name, data in members.items():
                    archive.writestr(name, data)
                archive.writestr(CHECKPOINT_META, json.dumps(meta, sort_keys=True))
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_path(final.parent)
    return final


def read_checkpoint(
    path: Path,
    *,
    step: int | None = None,
    shard: int | None = None,
    num_shards: int | None = None,
) -> CheckpointData | None:
    """Read and verify one checkpoint file; None if it is missing, partial or corrupt
    (or names another step or shard than asked)."""
    try:
        blob = Path(path).read_bytes()
    except OSError:
        return None
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            contents = {name: archive.read(name) for name in archive.namelist()}
        meta = json.loads(contents.pop(CHECKPOINT_META))
        digests = meta["sha256"]
        meta_step, meta_shard, meta_shards = meta["step"], meta["shard"], meta["num_shards"]
    except (zipfile.BadZipFile, KeyError, ValueError, TypeError, OSError, EOFError):
        return None
    if meta.get("format") != _FORMAT or not isinstance(digests, dict):
        return None
    if not all(isinstance(v, int) for v in (meta_step, meta_shard, meta_shards)):
        return None
    world = meta.get("world")
    if world is not None and (not isinstance(world, int) or isinstance(world, bool) or world < 0):
        return None
    expected = (step, shard, num_shards)
    actual = (meta_step, meta_shard, meta_shards)
    if any(want is not None and want != got for want, got in zip(expected, actual, strict=True)):
        return None
    if set(digests) != set(contents):
        return None
    for name, data in contents.items():
        if hashlib.sha256(data).hexdigest() != digests[name]:
            return None
    return CheckpointData(Path(path), meta_step, meta_shard, meta_shards, contents, world)


def list_checkpoints(
    tier_dirs: Sequence[Path],
    shard: int,
    num_shards: int,
    *,
    accept: Callable[[CheckpointData], bool] | None = None,
) -> dict[int, Path]:
    """Every step this shard can be loaded from: step -> a verified file.

    When several tiers hold a step, the first tier in `tier_dirs` whose file verifies and
    that `accept` takes wins (put the fastest first). Every candidate is read and
    verified, so this costs one read per file.
    """
    found: dict[int, Path] = {}
    for tier_dir in tier_dirs:
        for step in checkpoint_steps(tier_dir):
            if step in found:
                continue
            path = checkpoint_file(tier_dir, step, shard, num_shards)
            data = read_checkpoint(path, step=step, shard=shard, num_shards=num_shards)
            if data is not None and (accept is None or accept(data)):
                found[step] = path
    return dict(sorted(found.items()))


def newest_checkpoint(
    tier_dirs: Sequence[Path], shard: int, num_shards: int
) -> tuple[int, Path] | None:
    """The newest complete, verified checkpoint of this shard in any tier, or None.

    Ties between tiers go to the first in `tier_dirs`. Reads only until one verifies.
    """
    candidates: dict[int, list[Path]] = {}
    for tier_dir in tier_dirs:
        for step in checkpoint_steps(tier_dir):
            candidates.setdefault(step, []).append(
                checkpoint_file(tier_dir, step, shard, num_shards)
            )
    for step in sorted(candidates, reverse=True):
        for path in candidates[step]:
            if read_checkpoint(path, step=step, shard=shard, num_shards=num_shards):
                return step, path
    return None

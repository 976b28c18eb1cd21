"""A step's checkpoint as one standard DCP checkpoint: the ranks' metadata merged.

Each rank writes its own directory with DCP's metadata for what it holds (`no_dist`: no
collective, so that background saves and emergency saves from ranks stuck in a
collective work alike). For a sharded tensor (a DTensor), a rank's metadata already names
the tensor's global shape and the offsets of the shards it wrote. Merging the ranks'
metadata, each file path prefixed with its rank directory, gives DCP's global metadata of
the step: written as `<step>/.metadata` once every rank needed has committed (`publish`),
the step directory is a checkpoint that `torch.distributed.checkpoint.load` and
`dcp_to_torch_save` read without this package.

A restore reads through a view (`open_view`): a directory of symbolic links, one per
saving rank, each to the copy of that rank's directory chosen for it (this node's RAM,
the partner's copy, durable storage), beside the merged metadata. DCP's planner then
reads from each rank's files just the pieces of the shards this rank needs, whatever the
layout it saves with now (another world size, another mesh: resharding).

Where several ranks hold the same shard (HSDP replicas, replicated tensors, the step and
other small items every rank writes), the first directory given wins: its own rank's
when a rank passes it first, so each rank gets back its own RNG state and data position.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import secrets
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from resiliency_protocol.checkpoint_manifest import MANIFEST
from training.checkpoint import format as fmt
from training.checkpoint.state import local_numel

if TYPE_CHECKING:
    from training.checkpoint.commit_fence import CommitFence

METADATA = ".metadata"
_VIEW_PREFIX = ".view-"


def rank_metadata(directory: Path) -> Metadata:
    """The DCP metadata one rank wrote; CheckpointCorrupt when it cannot be read."""
    try:
        return FileSystemReader(str(directory)).read_metadata()
    except Exception as exc:  # a truncated or foreign pickle raises anything
        raise fmt.CheckpointCorrupt(f"{directory / METADATA}: unreadable ({exc!r})") from None


def merge(parts: Sequence[tuple[str, Metadata]]) -> Metadata:
    """One metadata for the ranks' `parts` ((directory relative to the checkpoint, its
    metadata), preferred first): every tensor's chunks once, each file path prefixed."""
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    planner_data: dict[str, Any] = {}
    for prefix, metadata in parts:
        stored = metadata.storage_data or {}

        def moved(index: MetadataIndex, prefix: str = prefix, stored: Any = stored) -> Any:
            info = stored[index]
            return dataclasses.replace(info, relative_path=f"{prefix}/{info.relative_path}")

        for fqn, item in metadata.state_dict_metadata.items():
            if isinstance(item, BytesStorageMetadata):
                if fqn not in state:
                    state[fqn] = item
                    storage[MetadataIndex(fqn)] = moved(MetadataIndex(fqn))
                continue
            have = state.get(fqn)
            if have is None:
                have = state[fqn] = TensorStorageMetadata(item.properties, item.size, [])
            elif not isinstance(have, TensorStorageMetadata) or have.size != item.size:
                raise fmt.CheckpointCorrupt(
                    f"{prefix}: {fqn} has shape {list(item.size)}, another rank's "
                    f"{list(getattr(have, 'size', []))}"
                )
            offsets = {tuple(chunk.offsets) for chunk in have.chunks}
            for chunk in item.chunks:
                if tuple(chunk.offsets) in offsets:
                    continue
                have.chunks.append(chunk)
                storage[MetadataIndex(fqn, chunk.offsets)] = moved(
                    MetadataIndex(fqn, chunk.offsets)
                )
        for key, value in (metadata.planner_data or {}).items():
            planner_data.setdefault(key, value)
    return Metadata(state_dict_metadata=state, planner_data=planner_data, storage_data=storage)


def write_metadata(path: Path, metadata: Metadata, *, sync: bool = True) -> None:
    """Write DCP metadata to `path` atomically (a temporary file renamed into place)."""
    temp = path.parent / f"{fmt.TMP_PREFIX}{path.name}-{os.getpid()}-{secrets.token_hex(4)}"
    with open(temp, "wb") as f:
        pickle.dump(metadata, f)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(temp, path)


def _fenced_write(path: Path, metadata: Metadata, *, sync: bool, fence: CommitFence | None) -> None:
    """Write a step's metadata in a durable tier: refused (StaleWorldCommit) when a newer
    world sealed this one's commits before, and taken back when it did meanwhile (the
    step is then the newer world's to describe)."""
    if fence is not None:
        fence.check(fence.rank)
    write_metadata(path, metadata, sync=sync)
    if fence is not None:
        try:
            fence.check(fence.rank)
        except Exception:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            raise


def publish(
    root: Path,
    step: int,
    ranks: Sequence[int],
    *,
    sync: bool = True,
    fence: CommitFence | None = None,
) -> bool:
    """Write the step's global metadata once every rank of `ranks` has committed its
    directory under `root`; True when written. Any rank may call it after its commit: the
    last to commit sees every directory, and two writers write the same bytes. `fence`:
    a durable tier's commit fence (commit_fence.py)."""
    directories = {rank: fmt.rank_dir(root, step, rank) for rank in ranks}
    if not all((d / MANIFEST).is_file() for d in directories.values()):
        return False
    merged = merge([(d.name, rank_metadata(d)) for d in directories.values()])
    _fenced_write(fmt.step_dir(root, step) / METADATA, merged, sync=sync, fence=fence)
    return True


def consolidate(step_directory: Path, fence: CommitFence | None = None) -> list[int]:
    """Write the global metadata of a step directory from the rank directories it holds
    (for a step whose last rank never got to `publish`: an emergency save, a job that
    died mid-save); the ranks merged. `fence`: the durable tier's commit fence, when a
    rank of a fenced world writes it (a store's `fence`)."""
    ranks = sorted(
        int(child.name.removeprefix("rank-"))
        for child in step_directory.iterdir()
        if child.name.startswith("rank-") and (child / MANIFEST).is_file()
    )
    parts = [(f"rank-{r}", rank_metadata(step_directory / f"rank-{r}")) for r in ranks]
    _fenced_write(step_directory / METADATA, merge(parts), sync=True, fence=fence)
    return ranks


@contextlib.contextmanager
def open_view(base: Path, sources: Mapping[int, Path], first: int | None) -> Iterator[Path]:
    """A directory under `base` that reads as one DCP checkpoint of the saving ranks'
    directories `sources` (rank -> directory); `first`: the rank whose items win where
    several hold the same (this rank's own, when it saved at that step). Removed after."""
    view = Path(base) / f"{_VIEW_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    view.mkdir(parents=True)
    try:
        order = sorted(sources, key=lambda r: (r != first, r))
        parts = []
        for rank in order:
            link = view / f"rank-{rank}"
            link.symlink_to(Path(sources[rank]).resolve(), target_is_directory=True)
            parts.append((link.name, rank_metadata(link)))
        write_metadata(view / METADATA, merge(parts), sync=False)
        yield view
    finally:
        shutil.rmtree(view, ignore_errors=True)


def remove_views(base: Path) -> None:
    """Remove this process's predecessors' views left by a kill mid-restore."""
    with contextlib.suppress(OSError):
        for child in Path(base).iterdir():
            if child.name.startswith(_VIEW_PREFIX):
                shutil.rmtree(child, ignore_errors=True)


def ranks_read(sources: Mapping[int, Path], first: int | None, target: dict[str, Any]) -> set[int]:
    """The saving ranks of `sources` (rank -> directory, its DCP metadata there) whose
    files a load of `target` through `open_view(..., sources, first)` reads: DCP's plan,
    made from the metadata alone. A rank restoring in the layout it saved with reads its
    own directory only, so a bucket's other rank directories need no download."""
    order = sorted(sources, key=lambda r: (r != first, r))
    merged = merge([(f"rank-{rank}", rank_metadata(sources[rank])) for rank in order])
    planner = DefaultLoadPlanner()
    planner.set_up_planner(target, merged, is_coordinator=False)
    storage = merged.storage_data or {}
    ranks = set()
    for item in planner.create_local_plan().items:
        prefix = storage[item.storage_index].relative_path.split("/", 1)[0]
        ranks.add(int(prefix.removeprefix("rank-")))
    return ranks


def missing(metadata: Metadata, target: dict[str, Any]) -> list[str]:
    """What of `target` (a state dict to load into) `metadata` cannot fill: keys it lacks
    and tensors whose local part its chunks do not cover whole. Reads no data."""
    planner = DefaultLoadPlanner(allow_partial_load=True)
    planner.set_up_planner(target, metadata, is_coordinator=False)
    plan = planner.create_local_plan()
    covered: dict[str, int] = {}
    for item in plan.items:
        volume = 1
        for length in item.lengths:
            volume *= int(length)
        covered[item.dest_index.fqn] = covered.get(item.dest_index.fqn, 0) + volume
    gaps = []
    for fqn, value in planner.state_dict.items():
        if fqn not in metadata.state_dict_metadata:
            gaps.append(fqn)
        elif isinstance(value, torch.Tensor):
            held = local_numel(value)
            if covered.get(fqn, 0) < held:
                gaps.append(f"{fqn} ({covered.get(fqn, 0)} of {held} elements)")
    return gaps

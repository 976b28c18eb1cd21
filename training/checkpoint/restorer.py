"""Where a rank's checkpoint of a step can be read from, and the load itself.

`candidates()` lists, without reading any data, the steps this rank can load and their
sources fastest first, tier by tier (tiers.py: this node's RAM, the partner's copy,
durable storage). `load(step, sources)` loads one step into the live state from the first source
that verifies, checking every file against its manifest's checksums as it reads it.

Two shapes of state:
- Whole states (DDP, a single process): one rank directory is the whole state. A step's
  sources are directories, any of which serves (other ranks' too, when the state is
  replicated: a replacement rank, a rank torchrun moved to another node).
- Sharded states (FSDP2, HSDP, tensor parallel): a step is the union of its ranks'
  directories. A step's sources are, per saving rank, that rank's directories fastest
  first; this rank loads through a view of one directory per saving rank
  (global_view.open_view), reading only the pieces of other ranks' shards its own
  layout needs. A step counts as loadable when those directories' metadata cover every
  tensor of this rank's state (`global_view.missing`): a shard lost with its node but
  held by another replica (HSDP) is read from that replica.
"""

from __future__ import annotations

import logging
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeAlias

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from resiliency_protocol.checkpoint_manifest import Manifest
from resiliency_protocol.checkpoint_reports import Tier
from training.checkpoint import ddp_order, fencing, global_view
from training.checkpoint import format as fmt
from training.checkpoint.reader import DirectReader
from training.checkpoint.settings import CheckpointSettings
from training.checkpoint.state import TrainingState
from training.checkpoint.tiers import CheckpointTier, Opened, Tiers

log = logging.getLogger(__name__)

#: Where a restore read a state from: the tiers that serve loads, or this process's own
#: memory (an in-process restart rewinds instead of loading).
Source: TypeAlias = Tier | Literal["memory"]
#: Files up to this size (DCP's metadata) are verified before a load reads them; larger
#: ones (the shards) as the load reads them.
VERIFY_FIRST_BYTES = 1 << 20
_RANK_PATH = re.compile(r"rank-(\d+)/")


@dataclass(frozen=True)
class Copy:
    """A saving rank's committed step in one tier: opened as it was listed, or (a lazy
    tier's: the partner's copy) when it is loaded."""

    tier: CheckpointTier
    rank: int
    listed: Opened | None = None

    def open(self, step: int) -> Opened:
        return self.listed if self.listed is not None else self.tier.load(step, self.rank)

    @property
    def directory(self) -> Path:
        """The directory of a copy opened as listed (every copy of a sharded state)."""
        assert self.listed is not None
        return self.listed.directory


#: A whole state's sources: its copies fastest first.
WholeSources = list[Copy]
#: A sharded state's sources: per saving rank, its copies (opened) fastest first.
ShardSources = dict[int, list[Copy]]


@dataclass(frozen=True)
class Loaded:
    tier: Source  # the slowest source read from
    size: int  # bytes of the directories read
    #: Sharded states: the tier each saving rank's directory was read from.
    sources: dict[int, Source]


class Restorer:
    def __init__(
        self,
        state: TrainingState,
        settings: CheckpointSettings,
        *,
        rank: int,
        replicated: bool,
        tiers: Tiers,
        on_state_changing: Callable[[], None],
    ) -> None:
        """`on_state_changing`: called right before a load writes into the live tensors."""
        self.state = state
        self.settings = settings
        self.rank = rank
        self.replicated = replicated
        self.tiers = tiers
        #: Tiers from fastest to slowest: a sharded restore reports the slowest it read.
        self.speed: dict[Source, int] = {"memory": -1}
        self.speed.update({tier.kind: i for i, tier in enumerate(tiers)})
        self._changing = on_state_changing
        #: The worlds that started, and from which step: shadowed commits are left out
        #: (fencing.py). Set by the agreement before `candidates()`.
        self.starts: list[fencing.WorldStart] = []
        #: A gathered state's (FSDP1's) state dict, read once per restore by every rank
        #: together (`begin`): each load fills it, and it is applied once the ranks agree
        #: (`apply_loaded`), both collectives that no rank may skip.
        self._template: dict[str, Any] | None = None
        self._loaded: dict[str, Any] | None = None

    def begin(self) -> None:
        """Start a restore (every rank, together)."""
        self._loaded = None
        self._template = self.state.state_dict(0) if self.state.gathered else None

    def end(self) -> None:
        """The restore is over: drop the copy of a gathered state (a whole shard set)."""
        self._template = self._loaded = None

    def apply_loaded(self) -> None:
        """Put what the agreed load filled into a gathered state (every rank, together);
        nothing for other states, which a load fills in place."""
        loaded, self._loaded = self._loaded, None
        if self._template is not None:
            if loaded is None:
                raise RuntimeError("the ranks agreed on a step this rank did not load")
            self._changing()
            self.state.apply(loaded)

    def _target(self, step: int) -> dict[str, Any]:
        """The state dict a load of `step` fills: the live state, or a gathered state's
        copy read at `begin`."""
        if self._template is None:
            return self.state.state_dict(step)
        self._template["step"] = step
        return self._template

    @property
    def sharded(self) -> bool:
        return self.state.sharded and not self.replicated

    def _shadowed(self, where: object, world: int | None, step: int) -> bool:
        """Whether a commit of `world` at `step` is on a branch a newer world left."""
        if not fencing.shadowed(world, step, self.starts):
            return False
        log.warning(
            "checkpoint: skipping %s: step %d of world %s, shadowed by a newer world's start (%s)",
            where,
            step,
            "unknown" if world is None else world,
            ", ".join(f"world {s.world} from step {s.step}" for s in self.starts[-3:]),
        )
        return True

    def _wanted(self, committed: Callable[[], list[int]], every: bool) -> list[int]:
        """This rank first, then (when `every`) the other ranks a tier holds."""
        if not every:
            return [self.rank]
        return [self.rank] + [r for r in committed() if r != self.rank]

    def _listed(self, tier: CheckpointTier, every: bool) -> Iterator[tuple[int, Copy]]:
        """(step, copy) of the committed rank directories in `tier`, opened: this rank's,
        and every rank's when `every` (a bucket's are staged locally: manifest and DCP
        metadata only). A tier that cannot be listed is skipped, and said in the log."""
        try:
            found = [
                (rank, step)
                for rank in self._wanted(tier.ranks, every)
                for step in tier.steps(rank)
            ]
        except Exception as exc:  # a bucket down: the other tiers may still serve
            log.warning("checkpoint: %s not listed: %r", tier.where, exc)
            return
        for rank, step in found:
            try:
                opened = tier.load(step, rank)
                manifest = opened.manifest
                if not tier.admits(manifest):
                    log.warning(
                        "checkpoint: skipping %s step %d rank %d: world %s committed it "
                        "after a newer world fenced that world out",
                        tier.where,
                        step,
                        rank,
                        manifest.world,
                    )
                elif not self._shadowed(f"{tier.where} rank {rank}", manifest.world, step):
                    yield step, Copy(tier, rank, opened)
            except fmt.CheckpointCorrupt as exc:
                log.warning("checkpoint: skipping %s", exc)
            except Exception as exc:
                log.warning("checkpoint: %s step %d rank %d: %r", tier.where, step, rank, exc)

    def _lazy_steps(self, tier: CheckpointTier) -> list[int]:
        """The steps of this rank a lazy tier holds, unless shadowed (nothing opened)."""
        try:
            return [
                step
                for step in tier.steps(self.rank)
                if not self._shadowed(tier.where, tier.world(step, self.rank), step)
            ]
        except Exception as exc:
            log.warning("checkpoint: %s not listed: %r", tier.where, exc)
            return []

    # --- whole states -----------------------------------------------------------------

    def candidates(self) -> dict[int, Any]:
        """Steps this rank can load, with their sources (no data read)."""
        return self._sharded_candidates() if self.sharded else self._whole_candidates()

    def _whole_candidates(self) -> dict[int, Any]:
        """Steps with their sources fastest first. With a replicated state, other ranks'
        directories count too, after this rank's own in each tier."""
        out: dict[int, WholeSources] = {}
        for tier in self.tiers:
            if tier.lazy:
                for step in self._lazy_steps(tier):
                    out.setdefault(step, []).append(Copy(tier, self.rank))
                continue
            for step, copy in self._listed(tier, self.replicated):
                out.setdefault(step, []).append(copy)
        return dict(out)

    def load(self, step: int, sources: Any) -> Loaded | None:
        """Load `step` from the first of its sources that verifies; None if none does."""
        if self.sharded:
            return self._load_sharded(step, sources)
        copy: Copy
        for copy in sources:
            try:
                opened = copy.open(step)
            except fmt.CheckpointCorrupt as exc:  # a lazy tier's copy not fetched
                log.info("checkpoint: step %d: %s", step, exc)
                continue
            directory = opened.directory
            try:
                self._complete(copy, directory)
                manifest = fmt.read_manifest(directory, step=step)
                self._read(step, directory, {"": (directory, manifest)}, verified=opened.verified)
            except (fmt.CheckpointCorrupt, OSError, RuntimeError, KeyError, ValueError) as exc:
                log.warning(
                    "checkpoint: step %d from %s not loadable: %s", step, copy.tier.kind, exc
                )
                copy.tier.discard(step, self.rank)
                continue
            return Loaded(copy.tier.kind, manifest.total_bytes, {})
        return None

    # --- sharded states ---------------------------------------------------------------

    def _sharded_candidates(self) -> dict[int, Any]:
        found: dict[int, ShardSources] = {}
        for tier in self.tiers:
            if tier.lazy:
                self._add_lazy_copies(tier, found)
                continue
            for step, copy in self._listed(tier, True):
                found.setdefault(step, {}).setdefault(copy.rank, []).append(copy)
        out: dict[int, ShardSources] = {}
        target = self._target(0) if found else {}  # shapes only: read once
        for step, sources in found.items():
            gaps = self._gaps(sources, target)
            if gaps:
                log.info("checkpoint: step %d lacks %s here", step, ", ".join(gaps[:3]))
            else:
                out[step] = sources
        return dict(out)

    def _add_lazy_copies(self, tier: CheckpointTier, found: dict[int, ShardSources]) -> None:
        """A lazy tier's copy of this rank's step (the partner's), opened now when no
        faster tier holds it (a replacement node): only its metadata tells what it
        covers."""
        for step in self._lazy_steps(tier):
            if found.get(step, {}).get(self.rank):
                continue
            try:
                opened = tier.load(step, self.rank)
                manifest = fmt.read_manifest(opened.directory, step=step, rank=self.rank)
            except fmt.CheckpointCorrupt as exc:
                log.warning("checkpoint: skipping %s", exc)
                continue
            if not self._shadowed(opened.directory, manifest.world, step):
                copies = found.setdefault(step, {}).setdefault(self.rank, [])
                copies.append(Copy(tier, self.rank, opened))

    def _gaps(self, sources: ShardSources, target: dict[str, Any]) -> list[str]:
        parts = []
        for rank in sorted(sources, key=lambda r: (r != self.rank, r)):
            for copy in sources[rank]:
                try:
                    parts.append((f"rank-{rank}", global_view.rank_metadata(copy.directory)))
                    break
                except fmt.CheckpointCorrupt as exc:
                    log.warning("checkpoint: skipping %s", exc)
        if not parts:
            return ["every rank's directory"]
        try:
            merged = global_view.merge(parts)
        except fmt.CheckpointCorrupt as exc:
            return [str(exc)]
        return global_view.missing(merged, target)

    def _load_sharded(self, step: int, sources: ShardSources) -> Loaded | None:
        left = {rank: list(found) for rank, found in sources.items()}
        while all(left.values()) and left:
            target = self._target(step)
            chosen = self._read_from({rank: found[0] for rank, found in left.items()}, target)
            base = self.tiers.local_root or tempfile.gettempdir()
            try:
                for rank, copy in chosen.items():
                    self._complete(copy, copy.directory, rank)
                with global_view.open_view(
                    Path(base), {rank: c.directory for rank, c in chosen.items()}, self.rank
                ) as view:
                    parts = {
                        f"rank-{rank}": (
                            c.directory,
                            fmt.read_manifest(c.directory, step=step, rank=rank),
                        )
                        for rank, c in chosen.items()
                    }
                    read = self._read(step, view, parts, verified=False, target=target)
            except (fmt.CheckpointCorrupt, OSError, RuntimeError, KeyError, ValueError) as exc:
                bad = {int(m.group(1)) for m in _RANK_PATH.finditer(str(exc))} & set(left)
                log.warning("checkpoint: step %d not loadable as chosen: %s", step, exc)
                if not bad:
                    return None
                for rank in bad:
                    left[rank].pop(0).tier.discard(step, rank)
                if any(not left[rank] for rank in bad) and self._gaps(
                    {r: f for r, f in left.items() if f}, self._target(step)
                ):
                    return None
                left = {r: f for r, f in left.items() if f}
                continue
            used: dict[int, Source] = {
                rank: chosen[rank].tier.kind for rank in read if rank in chosen
            }
            fastest = next(iter(self.tiers)).kind
            tier = max(used.values(), key=self.speed.__getitem__, default=fastest)
            size = sum(parts[f"rank-{rank}"][1].total_bytes for rank in used)
            return Loaded(tier, size, used)
        return None

    def _read_from(self, chosen: dict[int, Copy], target: dict[str, Any]) -> dict[int, Copy]:
        """Of the saving ranks' chosen directories, those the load reads (in the layout
        it was saved with, this rank's own alone): a bucket's others are not
        downloaded. All of them when the plan cannot be made from their metadata (the
        load then says what is wrong)."""
        try:
            needed = global_view.ranks_read(
                {rank: c.directory for rank, c in chosen.items()}, self.rank, target
            )
        except Exception as exc:  # a damaged metadata file: the load names the rank
            log.info("checkpoint: no read plan from the ranks' metadata: %r", exc)
            return chosen
        return {rank: chosen[rank] for rank in chosen if rank in needed} or chosen

    def _complete(self, copy: Copy, directory: Path, rank: int | None = None) -> None:
        """Make a listed directory whole (a bucket's files beyond its metadata); a
        failure is a CheckpointCorrupt naming the rank (so that another source is
        tried)."""
        try:
            copy.tier.complete(directory)
        except Exception as exc:
            where = f"rank-{rank}/" if rank is not None else ""
            raise fmt.CheckpointCorrupt(f"{copy.tier.where} {where}: {exc!r}") from None

    # --- the load ---------------------------------------------------------------------

    def _read(
        self,
        step: int,
        path: Path,
        parts: dict[str, tuple[Path, Manifest]],
        *,
        verified: bool,
        target: dict[str, Any] | None = None,
    ) -> set[int]:
        """Load the checkpoint at `path` (a rank directory, or a view whose `parts` are
        its rank directories by prefix) into the live state, each file checked against
        its manifest (unless `verified` already): the small ones before (DCP's metadata),
        the shards as they are read (one pass over the bytes, not two), any file the load
        left unread after. Raises CheckpointCorrupt when a sum disagrees: the live tensors
        then hold a part of it, which the next source's load overwrites whole. Returns
        the saving ranks whose files were read (views only). `target`: the state dict to
        load into, when the caller has made it already."""
        threads = self.settings.ckpt_threads_per_rank
        forms = {manifest.format for _, manifest in parts.values()}
        checksum = next(iter(parts.values()))[1].checksum
        sums: dict[str, tuple[int, int]] = {}
        small: dict[str, list[str]] = {}
        for prefix, (directory, manifest) in parts.items():
            small[prefix] = [n for n, e in manifest.files.items() if e.size <= VERIFY_FIRST_BYTES]
            if not verified:
                fmt.verify(directory, manifest, threads=threads, names=small[prefix])
                if len(forms) == 1:
                    sums.update(
                        {
                            _joined(prefix, n): (e.size, e.checksum)
                            for n, e in manifest.files.items()
                        }
                    )
        if not verified and len(forms) > 1:  # mixed checksum formats: verify whole, first
            for directory, manifest in parts.values():
                fmt.verify(directory, manifest, threads=threads)
        reader = DirectReader(path, thread_count=threads, sums=sums, checksum=checksum)
        if target is None:
            target = self._target(step)
        if self._template is None:
            self._changing()
        if (
            ddp_order.KEY in target
            and ddp_order.KEY not in reader.read_metadata().state_dict_metadata
        ):
            del target[ddp_order.KEY]  # a checkpoint from before DDP's order was kept
        try:
            dcp_load(target, storage_reader=reader, no_dist=True)
        except (Exception, CheckpointException):
            # A damaged shard can fail the load itself rather than its sum: say which.
            if not verified:
                for directory, manifest in parts.values():
                    fmt.verify(directory, manifest, threads=threads)
            raise
        if reader.corrupt:
            raise fmt.CheckpointCorrupt("; ".join(reader.corrupt))
        if not verified and sums:
            for prefix, (directory, manifest) in parts.items():
                unread = [
                    n
                    for n in manifest.files
                    if _joined(prefix, n) not in reader.summed
                    and n not in small[prefix]
                    # A view's other ranks' files are read only where this layout needs.
                    and (not prefix or _joined(prefix, n) in reader.opened)
                ]
                fmt.verify(directory, manifest, threads=threads, names=unread)
        if self._template is not None:  # applied once every rank loaded
            if int(target["step"]) != step:
                raise fmt.CheckpointCorrupt(f"{path}: holds another step")
            self._loaded = target
        elif self.state.apply(target) != step:
            raise fmt.CheckpointCorrupt(f"{path}: holds another step")
        return {int(m.group(1)) for f in reader.opened if (m := _RANK_PATH.match(f))}


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name

"""The checkpoint tiers as objects: what the saver writes to and the restorer reads from.

A tier is one place a rank's committed checkpoints are kept (`CheckpointTier`): it lists
the steps of a rank it holds, saves a committed rank directory, loads one into a local
directory, and removes one; its `kind` is its member of `Tier` (the wire's table). Three
implement it, fastest first:

- `RamTier`: a tmpfs directory on the node (format.py's layout, committed by rename);
- `PeerCopyTier`: the partner node's copy of this rank's newest RAM step, through the
  node's host monitor (peer.py): a save asks for the copy, a load fetches it into RAM;
- `DurableTier`: a directory or a bucket (S3, GCS) behind durable.py's `DurableStore`.

The tiers a save is written to first, and a restore lists every rank of, also keep their
own retention, world starts and global metadata (`StoredTier`: RAM and durable). `Tiers`
holds a rank's tiers in order, fastest first; the saver and the restorer loop over them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from resiliency_protocol.checkpoint_manifest import MANIFEST, Manifest
from resiliency_protocol.checkpoint_reports import Tier
from training.checkpoint import fencing, global_view
from training.checkpoint import format as fmt
from training.checkpoint.commit_fence import CommitFence
from training.checkpoint.durable import DurableStore, open_store
from training.checkpoint.peer import PeerTier
from training.checkpoint.settings import CheckpointSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Opened:
    """A tier's committed rank directory, readable here."""

    directory: Path
    #: Its committed manifest (a staged directory may lack the files it names yet).
    manifest: Manifest
    #: Every file was checked against the manifest as it arrived (a peer fetch).
    verified: bool = False


class CheckpointTier(Protocol):
    """One place a rank's committed checkpoints are kept."""

    @property
    def kind(self) -> Tier: ...

    #: For logs and errors: the tier and where it is, without credentials.
    @property
    def where(self) -> str: ...

    #: Opening a copy transfers the whole of it (the partner's): the restorer lists its
    #: steps and opens the copy only when it loads it.
    @property
    def lazy(self) -> bool: ...

    #: The tier whose commits this one copies (the partner's copy of RAM); None for a
    #: tier that a save's schedule names.
    @property
    def follows(self) -> Tier | None: ...

    def steps(self, rank: int) -> list[int]:
        """The committed steps of `rank` held here, ascending."""
        ...

    def ranks(self) -> list[int]:
        """The ranks with a committed step here."""
        ...

    def world(self, step: int, rank: int) -> int | None:
        """The world a committed step was written in (None: not known)."""
        ...

    def save(self, source: Path, manifest: Manifest) -> Path | None:
        """Copy a committed rank directory here, committed last; the local directory it
        is in now, if any."""
        ...

    def load(self, step: int, rank: int) -> Opened:
        """A local directory of the committed step holding at least its manifest and
        DCP's metadata (`complete` fetches the rest); CheckpointCorrupt when it cannot."""
        ...

    def complete(self, directory: Path) -> None:
        """Make a directory from `load` whole."""
        ...

    def admits(self, manifest: Manifest) -> bool:
        """Whether this world's restore may load the commit (a commit fence's verdict)."""
        ...

    def remove(self, step: int, rank: int) -> None:
        """Remove a rank's committed step, its manifest first."""
        ...

    def discard(self, step: int, rank: int) -> None:
        """A copy of the step failed to load: drop what of it is on this node."""
        ...


class StoredTier(CheckpointTier, Protocol):
    """A tier a save writes into first, with its own retention and world starts."""

    #: Its local directory (RAM, a durable directory); None for a bucket.
    @property
    def root(self) -> Path | None: ...

    #: Seen by other nodes: its commits are checked against the rank's lease.
    @property
    def shared(self) -> bool: ...

    #: What fences its commits against newer worlds, if anything (commit_fence.py).
    @property
    def fence(self) -> CommitFence | None: ...

    def write_dir(self, step: int, rank: int) -> Path:
        """A fresh local directory for a save that writes here first."""
        ...

    def commit(self, temp: Path, manifest: Manifest) -> Path | None:
        """Commit `temp` (from `write_dir`) as its manifest's rank and step."""
        ...

    def manifest(self, step: int, rank: int) -> Manifest:
        """The committed manifest; CheckpointCorrupt when missing or unreadable."""
        ...

    def keep(self, world_size: int) -> int:
        """How many periodic steps of a rank retention keeps."""
        ...

    def retain(
        self, rank: int, keep: int, *, aside: Iterable[int], protect: Iterable[int]
    ) -> list[int]:
        """Remove all but the newest `keep` committed steps of `rank` (`aside`: emergency
        saves, see `format.beyond_retention`; `protect`: being copied elsewhere)."""
        ...

    def publish(self, step: int, ranks: Sequence[int], *, sync: bool) -> bool:
        """Write the step's merged DCP metadata once every rank of `ranks` committed."""
        ...

    def starts(self) -> list[fencing.WorldStart]:
        """The worlds that started here and the step each restored from (fencing.py)."""
        ...

    def record_start(self, start: fencing.WorldStart) -> None: ...

    def prepare(self, rank: int) -> None:
        """Before the first save: remove this rank's leftovers of saves cut short."""
        ...

    def clear_staged(self) -> None:
        """Remove what a restore downloaded to read (a bucket's)."""
        ...


#: The RAM steps a rank of a job of several ranks keeps at least (RamTier.keep).
MIN_KEPT_WITH_PEERS = 3


class RamTier:
    """A tmpfs directory on the node."""

    kind = Tier.RAM
    lazy = False
    follows: Tier | None = None
    shared = False
    fence: CommitFence | None = None

    def __init__(self, root: Path, *, keep: int, sync: bool, threads: int) -> None:
        self.root: Path = Path(root)
        self.where = f"RAM tier {self.root}"
        self._keep, self._sync, self._threads = keep, sync, threads

    def steps(self, rank: int) -> list[int]:
        return fmt.committed_steps(self.root, rank)

    def ranks(self) -> list[int]:
        return fmt.committed_ranks(self.root)

    def world(self, step: int, rank: int) -> int | None:
        return self.manifest(step, rank).world

    def save(self, source: Path, manifest: Manifest) -> Path:
        return fmt.copy_committed(
            source, manifest, self.root, sync=self._sync, threads=self._threads
        )

    def load(self, step: int, rank: int) -> Opened:
        directory = fmt.rank_dir(self.root, step, rank)
        return Opened(directory, fmt.read_manifest(directory, step=step, rank=rank))

    def complete(self, directory: Path) -> None:
        pass  # already whole

    def admits(self, manifest: Manifest) -> bool:
        return True

    def remove(self, step: int, rank: int) -> None:
        fmt.remove_step(self.root, step, rank)

    def discard(self, step: int, rank: int) -> None:
        self.remove(step, rank)

    def write_dir(self, step: int, rank: int) -> Path:
        return fmt.new_temp_dir(self.root, step, rank)

    def commit(self, temp: Path, manifest: Manifest) -> Path:
        final = fmt.rank_dir(self.root, manifest.step, manifest.rank)
        fmt.commit(temp, manifest, final, sync=self._sync)
        return final

    def manifest(self, step: int, rank: int) -> Manifest:
        return fmt.read_manifest(fmt.rank_dir(self.root, step, rank), step=step, rank=rank)

    def keep(self, world_size: int) -> int:
        # Several ranks keep two steps more. A rank killed while writing a step, or a node
        # lost while its newest step was still on its way to the partner (whose copy its
        # ranks then restore from), shares only an older step with the ranks that
        # committed; and with saves written in the background that rank can be two saves
        # behind them: its save of step s+1 still being written (its next one waits for
        # it) while the others committed s+1 and s+2. The step every rank shares is then s
        # (seen in CI: a survivor kept 22 and 23, the cut-off rank's partner had 21).
        return max(self._keep, MIN_KEPT_WITH_PEERS) if world_size > 1 else self._keep

    def retain(
        self, rank: int, keep: int, *, aside: Iterable[int], protect: Iterable[int]
    ) -> list[int]:
        return fmt.retain(self.root, rank, keep, protect=protect, aside=aside)

    def publish(self, step: int, ranks: Sequence[int], *, sync: bool) -> bool:
        return global_view.publish(self.root, step, ranks, sync=sync)

    def starts(self) -> list[fencing.WorldStart]:
        return fencing.read_local(self.root)

    def record_start(self, start: fencing.WorldStart) -> None:
        fencing.record_local(self.root, start)

    def prepare(self, rank: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        fmt.remove_temporaries(self.root, rank)

    def clear_staged(self) -> None:
        pass  # nothing downloaded


class DurableTier:
    """A directory or a bucket, through its store (durable.py)."""

    kind = Tier.DURABLE
    lazy = False
    follows: Tier | None = None
    shared = True

    def __init__(self, store: DurableStore, *, keep: int) -> None:
        self.store = store
        self.root = store.root
        self.fence: CommitFence = store.fence
        self.where = f"durable tier {store.url}"
        self._keep = keep

    def steps(self, rank: int) -> list[int]:
        return self.store.committed_steps(rank)

    def ranks(self) -> list[int]:
        return self.store.committed_ranks()

    def world(self, step: int, rank: int) -> int | None:
        return self.store.manifest(step, rank).world

    def save(self, source: Path, manifest: Manifest) -> Path | None:
        return self.store.copy_committed(source, manifest)

    def load(self, step: int, rank: int) -> Opened:
        directory = self.store.stage(step, rank)  # its manifest checked against the store
        return Opened(directory, _parsed(directory))

    def complete(self, directory: Path) -> None:
        self.store.fetch(directory)

    def admits(self, manifest: Manifest) -> bool:
        return not self.store.fenced_out(manifest)

    def remove(self, step: int, rank: int) -> None:
        self.store.remove(step, rank)

    def discard(self, step: int, rank: int) -> None:
        pass  # the stored copy stays: another rank, or a later restore, may read it

    def write_dir(self, step: int, rank: int) -> Path:
        return self.store.write_dir(step, rank)

    def commit(self, temp: Path, manifest: Manifest) -> Path | None:
        return self.store.commit(temp, manifest)

    def manifest(self, step: int, rank: int) -> Manifest:
        return self.store.manifest(step, rank)

    def keep(self, world_size: int) -> int:
        return self._keep

    def retain(
        self, rank: int, keep: int, *, aside: Iterable[int], protect: Iterable[int]
    ) -> list[int]:
        return self.store.retain(rank, keep, aside=aside)

    def publish(self, step: int, ranks: Sequence[int], *, sync: bool) -> bool:
        return self.store.publish(step, ranks, sync=sync)

    def starts(self) -> list[fencing.WorldStart]:
        return self.store.starts()

    def record_start(self, start: fencing.WorldStart) -> None:
        self.store.record_start(start)

    def prepare(self, rank: int) -> None:
        try:
            self.store.remove_temporaries(rank)
        except OSError as exc:  # a durable tier that is down fails its saves, reported
            log.warning("checkpoint: %s: %r", self.where, exc)

    def clear_staged(self) -> None:
        self.store.clear_staged()


class PeerCopyTier:
    """The partner node's copies of this rank's newest RAM steps (peer.py: the newest save
    and the one before it): a save asks the host monitor to copy a RAM commit; a load
    fetches a copy into the RAM tier."""

    kind = Tier.PEER
    lazy = True
    follows: Tier | None = Tier.RAM
    where = "the partner's copy"

    def __init__(self, client: PeerTier, ram: RamTier, *, saves: bool, loads: bool) -> None:
        """`saves`: ask for a copy of each RAM commit; `loads`: restores may read it."""
        self.client, self.ram = client, ram
        self._saves, self._loads = saves, loads
        self._copies: list[tuple[int, int | None]] | None = None

    def _kept(self, rank: int) -> list[tuple[int, int | None]]:
        if not self._loads or rank != self.client.rank:
            return []
        self._copies = self.client.copies()
        return self._copies

    def steps(self, rank: int) -> list[int]:
        return [step for step, _ in self._kept(rank)]

    def ranks(self) -> list[int]:
        return [self.client.rank] if self._loads else []

    def world(self, step: int, rank: int) -> int | None:
        copies = self._copies if self._copies is not None else self._kept(rank)
        return next((world for kept, world in copies if kept == step), None)

    def save(self, source: Path, manifest: Manifest) -> None:
        if self._saves:
            self.client.replicate(manifest.step, source)

    def load(self, step: int, rank: int) -> Opened:
        fetched = self.client.fetch(step, self.ram.root) if rank == self.client.rank else None
        if fetched is None:
            raise fmt.CheckpointCorrupt(f"{self.where} of step {step}: not fetched")
        # The host monitor checked sizes and checksums as it downloaded.
        directory, verified = fetched
        return Opened(directory, _parsed(directory), verified)

    def complete(self, directory: Path) -> None:
        pass  # fetched whole

    def admits(self, manifest: Manifest) -> bool:
        return True

    def remove(self, step: int, rank: int) -> None:
        self.ram.remove(step, rank)  # the fetched copy; the partner keeps its own

    def discard(self, step: int, rank: int) -> None:
        self.remove(step, rank)


def _parsed(directory: Path) -> Manifest:
    """The manifest of a directory whose files the load checks (staged, or fetched)."""
    try:
        return Manifest.parse((directory / MANIFEST).read_bytes())
    except (OSError, ValueError) as exc:
        raise fmt.CheckpointCorrupt(f"{directory}: no readable manifest ({exc})") from None


class Tiers:
    """A rank's tiers, fastest first."""

    def __init__(self, tiers: Sequence[CheckpointTier], stored: Sequence[StoredTier]) -> None:
        """`stored`: those of `tiers` that saves write into first (RAM, durable)."""
        self.all = list(tiers)
        self.stored = list(stored)

    def __iter__(self) -> Iterator[CheckpointTier]:
        return iter(self.all)

    def get(self, kind: Tier) -> CheckpointTier | None:
        return next((tier for tier in self.all if tier.kind == kind), None)

    def stored_of(self, kind: Tier) -> StoredTier | None:
        return next((tier for tier in self.stored if tier.kind == kind), None)

    def followers(self, kind: Tier) -> list[CheckpointTier]:
        """The tiers that copy each commit of `kind`'s and keep nothing of their own
        here (the partner's copy of RAM): a stored tier that follows one is written with
        it, its retention included."""
        return [t for t in self.all if t.follows == kind and t not in self.stored]

    @property
    def local_root(self) -> Path | None:
        """The fastest tier's local directory (where a restore builds its views)."""
        return next((tier.root for tier in self.stored if tier.root is not None), None)

    @classmethod
    def open(
        cls,
        settings: CheckpointSettings,
        *,
        rank: int,
        job: str | None,
        peer: PeerTier | None = None,
    ) -> Tiers:
        """The tiers `settings` turn on: RAM (`in_memory_checkpointing_freq`), the
        partner's copy of it (`enable_peer_ckpt`, `enable_ckpt_load_replication`), and
        durable (`s3_checkpointing_freq` or the backup interval). `peer`: the host
        monitor's client (default: from the worker client's variables)."""
        s = settings
        client = peer if peer is not None else PeerTier.from_env(rank)
        tiers: list[CheckpointTier] = []
        stored: list[StoredTier] = []
        ram: RamTier | None = None
        if s.in_memory_checkpointing_freq:
            ram = RamTier(
                s.ram_root(job),
                keep=s.ram_topk_ckpt,
                sync=s.sync_files,
                threads=s.ckpt_threads_per_rank,
            )
            tiers.append(ram)
            stored.append(ram)
            tiers.append(
                PeerCopyTier(
                    client, ram, saves=s.enable_peer_ckpt, loads=s.enable_ckpt_load_replication
                )
            )
        if s.s3_checkpointing_freq or s.multi_tier_checkpointing_backup_interval_minutes:
            # Beside the RAM tier (tmpfs) when there is one: a bucket's saves without a
            # RAM tier write there first, and its restores stage there.
            scratch = ram.root.parent / f".durable-{ram.root.name}" if ram else None
            store = open_store(s, scratch=scratch)
            if store is not None:
                durable = DurableTier(store, keep=s.topk_ckpt)
                tiers.append(durable)
                stored.append(durable)
        made = cls(tiers, stored)
        made.peer = client
        return made

    #: The host monitor's client the partner's copy goes through (closed with the tiers).
    peer: PeerTier | None = None

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()

"""The durable tier: a directory, or a bucket (S3 API, GCS), behind one small interface.

`open_store(settings)` gives a `LocalStore` for a path (`durable_dir`, or a `durable_url`
without a scheme) and an `ObjectStore` for `s3://bucket/prefix` or `gs://bucket/prefix`.
Both keep the layout of format.py (`step-<step>/rank-<rank>/<files>`, `manifest.json`).

A directory commits by rename, as the RAM tier does. A bucket has no rename (neither has
GCS FUSE): there a rank's step is committed when its `manifest.json` object exists, and it
is written last, after every file it names has been uploaded whole (each a single PUT or
a completed multipart upload, which S3 and GCS make visible atomically). An upload cut
short (the process killed, the store gone, a multipart upload never completed) has no
manifest, so it never counts; its objects are deleted by the next retention
(`topk_ckpt`), which removes every object of this rank's steps but the newest kept, the
manifest of a step first so that a step being deleted never looks committed. A save of a
step that already has a manifest (a run that went further, rolled back) deletes that
manifest before it uploads.

A restore reads a bucket's step through a local directory (`stage`, then `fetch`): the
manifest and DCP's small metadata first (to list candidates and check what they cover),
the shards only for the step it loads; checksums are then checked as for any tier.

Every commit here (a save's, the emergency copy from RAM, the step's merged `.metadata`)
goes through the tier's commit fence (commit_fence.py, fencing.py): `begin` before the
files, the manifest written only where there is none (a bucket: `If-None-Match: *` /
`ifGenerationMatch: 0`), then `advance`, the commit point; a commit the fence refuses
removes its manifest and raises StaleWorldCommit.
"""

from __future__ import annotations

import pickle
import re
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from resiliency_protocol.checkpoint_manifest import MANIFEST, Manifest
from training.checkpoint import fencing, global_view
from training.checkpoint import format as fmt
from training.checkpoint.buckets import Bucket, Conflict, open_bucket
from training.checkpoint.commit_fence import CommitFence
from training.checkpoint.records import BucketRecords, DirectoryRecords
from training.checkpoint.settings import CheckpointSettings
from training.errors import TrainingError

_STEP = re.compile(r"^step-(\d{10,})/$")
_RANK = re.compile(r"^rank-(\d+)/$")
#: Files up to this size are staged with the manifest (DCP's metadata).
SMALL_BYTES = 1 << 20


class DurableStore(ABC):
    #: Where it is, without credentials (logs, reports).
    url: str
    #: The directory of a LocalStore; None for a bucket.
    root: Path | None = None
    #: What fences its commits against newer worlds (commit_fence.py).
    fence: CommitFence

    def fenced_out(self, manifest: Manifest) -> bool:
        """Whether this world's restore must not load a commit (commit_fence.py)."""
        return not self.fence.admits(manifest.world, manifest.rank, manifest.step)

    @abstractmethod
    def committed_steps(self, rank: int) -> list[int]: ...

    @abstractmethod
    def committed_ranks(self) -> list[int]: ...

    @abstractmethod
    def write_dir(self, step: int, rank: int) -> Path:
        """A fresh local directory for a save that writes here first (no RAM tier)."""

    @abstractmethod
    def commit(self, temp: Path, manifest: Manifest) -> Path | None:
        """Commit `temp` (from `write_dir`) as its manifest's rank and step; the committed
        directory of a LocalStore, None for a bucket."""

    @abstractmethod
    def copy_committed(self, source: Path, manifest: Manifest) -> Path | None:
        """Copy a committed directory (of the RAM tier) here, committed last."""

    @abstractmethod
    def manifest(self, step: int, rank: int) -> Manifest:
        """The committed manifest; CheckpointCorrupt when missing or unreadable."""

    @abstractmethod
    def retain(self, rank: int, keep: int, aside: Iterable[int] = ()) -> list[int]:
        """Remove all but the newest `keep` committed steps of `rank` (`aside`: emergency
        saves, see `format.beyond_retention`); returns those removed."""

    @abstractmethod
    def remove_temporaries(self, rank: int) -> None: ...

    @abstractmethod
    def publish(self, step: int, ranks: Sequence[int], *, sync: bool) -> bool:
        """Write the step's merged DCP metadata once every rank of `ranks` committed."""

    @abstractmethod
    def stage(self, step: int, rank: int) -> Path:
        """A local directory of the committed rank directory holding at least its
        manifest and small files; CheckpointCorrupt when not committed or damaged."""

    @abstractmethod
    def fetch(self, directory: Path) -> None:
        """Complete a directory from `stage` with every file its manifest names."""

    @abstractmethod
    def clear_staged(self) -> None:
        """Remove what `stage` and `fetch` downloaded (after a restore)."""

    @abstractmethod
    def starts(self) -> list[fencing.WorldStart]:
        """The worlds that started and the step each restored from (fencing.py)."""

    @abstractmethod
    def record_start(self, start: fencing.WorldStart) -> None: ...

    @abstractmethod
    def remove(self, step: int, rank: int) -> None:
        """Remove a rank's step (a shadowed one: fencing.py), its manifest first."""


class LocalStore(DurableStore):
    def __init__(self, root: Path, *, threads: int, sync: bool) -> None:
        self.root = Path(root)
        self.url = str(root)
        self.threads, self.sync = threads, sync
        self.fence = CommitFence(DirectoryRecords(self.root, sync=sync), self.url)

    def _advance(self, manifest: Manifest) -> None:
        """The commit point; a refused commit's directory goes (no newer world counts it)."""
        assert self.root is not None
        try:
            self.fence.advance(manifest.rank, manifest.step)
        except TrainingError:  # a newer world's seal, or the rank's lease ran out
            fmt.remove_step(self.root, manifest.step, manifest.rank)
            raise

    def committed_steps(self, rank: int) -> list[int]:
        assert self.root is not None
        return fmt.committed_steps(self.root, rank)

    def committed_ranks(self) -> list[int]:
        assert self.root is not None
        return fmt.committed_ranks(self.root)

    def write_dir(self, step: int, rank: int) -> Path:
        assert self.root is not None
        return fmt.new_temp_dir(self.root, step, rank)

    def commit(self, temp: Path, manifest: Manifest) -> Path:
        assert self.root is not None
        final = fmt.rank_dir(self.root, manifest.step, manifest.rank)
        self.fence.begin(manifest.rank)
        fmt.commit(temp, manifest, final, sync=self.sync)
        self._advance(manifest)
        return final

    def copy_committed(self, source: Path, manifest: Manifest) -> Path:
        assert self.root is not None
        self.fence.begin(manifest.rank)
        final = fmt.copy_committed(
            source, manifest, self.root, sync=self.sync, threads=self.threads
        )
        self._advance(manifest)
        return final

    def manifest(self, step: int, rank: int) -> Manifest:
        assert self.root is not None
        return fmt.read_manifest(fmt.rank_dir(self.root, step, rank), step=step, rank=rank)

    def retain(self, rank: int, keep: int, aside: Iterable[int] = ()) -> list[int]:
        assert self.root is not None
        return fmt.retain(self.root, rank, keep, aside=aside)

    def remove_temporaries(self, rank: int) -> None:
        assert self.root is not None
        self.root.mkdir(parents=True, exist_ok=True)
        fmt.remove_temporaries(self.root, rank)

    def publish(self, step: int, ranks: Sequence[int], *, sync: bool) -> bool:
        assert self.root is not None
        return global_view.publish(self.root, step, ranks, sync=sync, fence=self.fence)

    def stage(self, step: int, rank: int) -> Path:
        assert self.root is not None
        directory = fmt.rank_dir(self.root, step, rank)
        fmt.read_manifest(directory, step=step, rank=rank)
        return directory

    def fetch(self, directory: Path) -> None:
        pass  # already whole

    def clear_staged(self) -> None:
        pass  # nothing downloaded

    def starts(self) -> list[fencing.WorldStart]:
        assert self.root is not None
        return fencing.read_local(self.root)

    def record_start(self, start: fencing.WorldStart) -> None:
        assert self.root is not None
        fencing.record_local(self.root, start)

    def remove(self, step: int, rank: int) -> None:
        assert self.root is not None
        fmt.remove_step(self.root, step, rank)


class ObjectStore(DurableStore):
    def __init__(self, bucket: Bucket, *, threads: int, scratch: Path | None = None) -> None:
        """`scratch`: where saves without a RAM tier write before the upload, and where a
        restore stages what it reads (default: the system's temporary directory)."""
        self.bucket = bucket
        self.url = bucket.url
        self.threads = threads
        self._scratch_base = scratch
        self._staged: Path | None = None
        self.fence = CommitFence(BucketRecords(bucket), bucket.url)

    # --- keys -------------------------------------------------------------------------

    @staticmethod
    def _dir(step: int, rank: int) -> str:
        return f"step-{step:010d}/rank-{rank}/"

    def _steps(self) -> list[int]:
        found = []
        for prefix in self.bucket.list("").prefixes:
            if match := _STEP.match(prefix):
                found.append(int(match.group(1)))
        return sorted(found)

    def _scratch(self) -> Path:
        base = self._scratch_base or Path(tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        return base

    # --- listing ----------------------------------------------------------------------

    def committed_steps(self, rank: int) -> list[int]:
        return [
            step
            for step in self._steps()
            if self.bucket.size(self._dir(step, rank) + MANIFEST) is not None
        ]

    def committed_ranks(self) -> list[int]:
        ranks: set[int] = set()
        for step in self._steps():
            for prefix in self.bucket.list(f"step-{step:010d}/").prefixes:
                match = _RANK.match(prefix.rsplit("/", 2)[-2] + "/")
                if match and int(match.group(1)) not in ranks:
                    key = self._dir(step, int(match.group(1))) + MANIFEST
                    if self.bucket.size(key) is not None:
                        ranks.add(int(match.group(1)))
        return sorted(ranks)

    def manifest(self, step: int, rank: int) -> Manifest:
        key = self._dir(step, rank) + MANIFEST
        try:
            manifest = Manifest.parse(self.bucket.get_bytes(key))
        except FileNotFoundError:
            raise fmt.CheckpointCorrupt(f"{self.url}/{key}: missing") from None
        except ValueError as exc:
            raise fmt.CheckpointCorrupt(f"{self.url}/{key}: {exc}") from None
        if manifest.step != step or manifest.rank != rank:
            raise fmt.CheckpointCorrupt(
                f"{self.url}/{key}: names step {manifest.step} rank {manifest.rank}"
            )
        return manifest

    # --- saving -----------------------------------------------------------------------

    def write_dir(self, step: int, rank: int) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"durable-{step}-{rank}-", dir=self._scratch()))

    def commit(self, temp: Path, manifest: Manifest) -> None:
        try:
            self.copy_committed(temp, manifest)
        finally:
            shutil.rmtree(temp, ignore_errors=True)

    def copy_committed(self, source: Path, manifest: Manifest) -> None:
        base = self._dir(manifest.step, manifest.rank)
        self.fence.begin(manifest.rank)
        # A manifest of this step from before (a run rolled back) must not name the
        # objects being replaced: it goes first. A newer world's is never replaced.
        if self.bucket.size(base + MANIFEST) is not None:
            try:
                before = self.manifest(manifest.step, manifest.rank).world
            except fmt.CheckpointCorrupt:
                before = None  # unreadable: replaced, as before
            if self.fence.world is not None and (before or -1) > self.fence.world:
                raise fencing.StaleWorldCommit(
                    f"{self.url}/{base}: written by world {before}, newer than this "
                    f"rank's {self.fence.world}: not replaced"
                )
            self.bucket.delete([base + MANIFEST])
        names = sorted(manifest.files, key=lambda n: -manifest.files[n].size)
        # Files in parallel, and the parts of each large file: together about `threads`.
        files_at_once = max(1, min(self.threads, len(names) or 1))
        parts_each = max(2, self.threads // files_at_once)

        def upload(name: str) -> None:
            self.bucket.put_file(base + name, source / name, parallel=parts_each)

        with ThreadPoolExecutor(files_at_once) as pool:
            list(pool.map(upload, names))
        self._put_manifest(base + MANIFEST, manifest)
        try:
            self.fence.advance(manifest.rank, manifest.step)
        except TrainingError:  # a newer world's seal, or the rank's lease ran out
            self.bucket.delete([base + MANIFEST])  # counted by no newer world
            raise

    def _put_manifest(self, key: str, manifest: Manifest) -> None:
        """Written only where there is none (a commit of this step meanwhile: refused)."""
        data = manifest.to_json().encode()
        if self.fence.world is None or self.fence.mode != "conditional":
            self.bucket.put_bytes(key, data)
            return
        try:
            self.bucket.put_if(key, data, None)
        except Conflict:
            found = self.bucket.read_versioned(key)
            if found is not None and found[0] == data:
                return  # this write's own, its answer lost and the request retried
            raise fencing.StaleWorldCommit(
                f"{self.url}/{key}: another commit of this step landed meanwhile"
            ) from None

    def retain(self, rank: int, keep: int, aside: Iterable[int] = ()) -> list[int]:
        """Every object of this rank's steps but the newest `keep` committed ones
        (`aside`: emergency saves, see `format.beyond_retention`), the leftovers of
        uploads cut short included."""
        steps = self._steps()
        committed = [
            s for s in steps if self.bucket.size(self._dir(s, rank) + MANIFEST) is not None
        ]
        kept = set(committed) - set(fmt.beyond_retention(committed, keep, aside))
        removed = []
        for step in steps:
            if step not in kept and self._remove(step, rank) and step in committed:
                removed.append(step)
        return removed

    def remove(self, step: int, rank: int) -> None:
        self._remove(step, rank)

    def _remove(self, step: int, rank: int) -> bool:
        """Every object of the rank's step, its manifest first; False when it had none."""
        listing = self.bucket.list(self._dir(step, rank))
        if not listing.objects:
            return False
        manifest = self._dir(step, rank) + MANIFEST
        if manifest in listing.objects:
            self.bucket.delete([manifest])
        self.bucket.delete(k for k in listing.objects if k != manifest)
        self._drop_global_metadata(step)
        return True

    def starts(self) -> list[fencing.WorldStart]:
        prefix = f"{fencing.STARTS}/"
        names = (key.removeprefix(prefix) for key in self.bucket.list(prefix).objects)
        return sorted(start for name in names if (start := fencing.WorldStart.parse(name)))

    def record_start(self, start: fencing.WorldStart) -> None:
        key = f"{fencing.STARTS}/{start.name}"
        if self.bucket.size(key) is None:
            self.bucket.put_bytes(key, b"")

    def _drop_global_metadata(self, step: int) -> None:
        """The step's merged metadata names files now gone once no rank's are left."""
        prefix = f"step-{step:010d}/"
        listing = self.bucket.list(prefix)
        ranks = [p for p in listing.prefixes if _RANK.match(p.removeprefix(prefix))]
        # A prefix may outlive its objects a moment (stores that keep folders): look in.
        if not any(self.bucket.list(p).objects for p in ranks):
            self.bucket.delete(k for k in listing.objects)

    def remove_temporaries(self, rank: int) -> None:
        pass  # uploads without a manifest never count; retention removes them

    def publish(self, step: int, ranks: Sequence[int], *, sync: bool) -> bool:
        for rank in ranks:
            if self.bucket.size(self._dir(step, rank) + MANIFEST) is None:
                return False
        parts = []
        for rank in ranks:
            key = self._dir(step, rank) + global_view.METADATA
            try:
                metadata = pickle.loads(self.bucket.get_bytes(key))
            except Exception as exc:  # a truncated or foreign pickle raises anything
                raise fmt.CheckpointCorrupt(f"{self.url}/{key}: unreadable ({exc!r})") from None
            parts.append((f"rank-{rank}", metadata))
        merged = global_view.merge(parts)
        key = f"step-{step:010d}/{global_view.METADATA}"
        self.fence.check(self.fence.rank)
        self.bucket.put_bytes(key, pickle.dumps(merged))
        try:
            self.fence.check(self.fence.rank)
        except fencing.StaleWorldCommit:
            self.bucket.delete([key])  # sealed meanwhile: the newer world's to write
            raise
        return True

    # --- restoring --------------------------------------------------------------------

    def _stage_root(self) -> Path:
        if self._staged is None:
            self._staged = Path(tempfile.mkdtemp(prefix="durable-staged-", dir=self._scratch()))
        return self._staged

    def stage(self, step: int, rank: int) -> Path:
        manifest = self.manifest(step, rank)
        base = self._dir(step, rank)
        sizes = self.bucket.list(base).objects
        for name, entry in manifest.files.items():
            size = sizes.get(base + name)
            if size is None:
                raise fmt.CheckpointCorrupt(f"{self.url}/{base}{name}: missing")
            if size != entry.size:
                raise fmt.CheckpointCorrupt(
                    f"{self.url}/{base}{name}: {size} bytes, manifest says {entry.size}"
                )
        directory = fmt.rank_dir(self._stage_root(), step, rank)
        directory.mkdir(parents=True, exist_ok=True)
        small = [n for n, e in manifest.files.items() if e.size <= SMALL_BYTES]
        self._download(base, directory, {n: manifest.files[n].size for n in small})
        (directory / MANIFEST).write_text(manifest.to_json())
        return directory

    def fetch(self, directory: Path) -> None:
        manifest = Manifest.parse((directory / MANIFEST).read_bytes())
        base = self._dir(manifest.step, manifest.rank)
        left = {
            name: entry.size
            for name, entry in manifest.files.items()
            if not (directory / name).is_file() or (directory / name).stat().st_size != entry.size
        }
        self._download(base, directory, left)

    def _download(self, base: str, directory: Path, sizes: dict[str, int]) -> None:
        """Files in parallel, and ranges of each large file: about `threads` at once."""
        files_at_once = max(1, min(self.threads, len(sizes) or 1))
        parts_each = max(2, self.threads // files_at_once)

        def get(name: str) -> None:
            got = self.bucket.get_file(
                base + name, directory / name, size=sizes[name], parallel=parts_each
            )
            if got != sizes[name]:
                raise fmt.CheckpointCorrupt(
                    f"{self.url}/{base}{name}: {got} bytes read, manifest says {sizes[name]}"
                )

        with ThreadPoolExecutor(files_at_once) as pool:
            list(pool.map(get, sorted(sizes, key=lambda n: -sizes[n])))

    def clear_staged(self) -> None:
        if self._staged is not None:
            shutil.rmtree(self._staged, ignore_errors=True)
            self._staged = None


def open_store(settings: CheckpointSettings, *, scratch: Path | None = None) -> DurableStore | None:
    """The durable tier of `settings`; None when it has none."""
    threads = settings.ckpt_threads_per_rank
    if settings.durable_url is not None:
        bucket = open_bucket(settings.durable_url, timeout_s=settings.durable_timeout_s)
        return ObjectStore(bucket, threads=threads, scratch=scratch)
    root = settings.durable_root()
    if root is None:
        return None
    return LocalStore(root, threads=threads, sync=settings.sync_files)

"""Writes staged states to the tiers, in the background, one save at a time.

A save job names the tiers it is due in (tiers.py), fastest first.
`torch.distributed.checkpoint` writes the staged state into a temporary directory of the
first (RAM, else durable: a directory, or local scratch space uploaded to a bucket) with
`ckpt_threads_per_rank` writer threads, each file checksummed as it is written
(writer.py); the sums go into the manifest and the directory is committed (by rename; in
a bucket, by the manifest uploaded last: durable.py); the tiers that follow it are asked
for their copy (the partner node's, through the host monitor); each later tier due then
copies the committed directory (the same files and manifest); retention keeps the newest
checkpoints of each tier. A later tier that fails (a bucket down past its bounded
retries) fails that save only: it is reported, and the first tier keeps the step.

A save due while the previous one is still being written waits for it: the staging
buffers are the previous save's until it is on disk, and skipping a save would silently
widen what a failure loses. The wait counts as blocking time, and is reported.

The later tiers' copies of a step the first tier committed are not part of that wait:
they run in a thread of their own, one upload at a time, so that a slow bucket never
holds up the next save. A copy due while the previous one is still under way is skipped
(the first tier, and the partner's copy, take that step): reported as a failed save that
says so, and not counted towards `max_consecutive_save_failures` (the bucket works,
slowly); the durable tier's checkpoint age shows it. The step being uploaded stays in
the first tier until then.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from resiliency_protocol.checkpoint_manifest import Manifest
from resiliency_protocol.checkpoint_reports import Tier
from training.checkpoint import format as fmt
from training.checkpoint.tiers import StoredTier, Tiers
from training.checkpoint.world_fence import WorldFence
from training.checkpoint.writer import SummingFileSystemWriter

log = logging.getLogger(__name__)

# Each rank writes and reads its own directory without a process group (no_dist=True) on
# purpose; torch warns about that on every call.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    category=UserWarning,
)


@dataclass
class SaveJob:
    step: int
    state: dict[str, Any]
    #: The stored tiers it is due in (fastest first: the first is written, the rest copy).
    kinds: tuple[Tier, ...]
    blocking_s: float  # grows if the next optimizer step waits for `finish_staging`
    started: float  # monotonic, when the loop asked for it
    #: Copies what the loop left to copy during its next step (see Checkpointer.save);
    #: run first, in the save's thread.
    finish_staging: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    #: Asked for by the host monitor (reported as the `emergency` tier).
    emergency: bool = False
    #: Written in a thread of its own (`Saver.submit`): its later tiers' copies are too.
    background: bool = False


@dataclass
class SaveResult:
    """One tier's outcome of one save (for reports and tests)."""

    step: int
    tier: Tier
    path: Path | None
    size: int
    blocking_s: float
    total_s: float
    error: str | None = None
    emergency: bool = False
    #: Of `total_s`, the seconds spent writing to this tier (after the copy to host
    #: memory): what the tier's throughput is measured on.
    write_s: float | None = None
    #: Not attempted: the tier's previous upload was still under way.
    skipped: bool = False
    #: A commit of a fenced world: how the tier fenced it ("conditional", or
    #: "read-then-write" where the store lacks conditional writes: commit_fence.py).
    fence: str | None = None
    #: The tier the save was written to first (not a copy).
    first: bool = False


class Saver:
    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        job: str | None,
        tiers: Tiers,
        threads: int,
        sync_files: bool,
        on_committed: Callable[[SaveResult], None],
        on_failed: Callable[[SaveResult], None] | None = None,
        replicated: bool = False,
        fence: WorldFence | None = None,
        lease: Callable[[str], None] | None = None,
    ) -> None:
        """`replicated`: rank 0's directory alone is the whole state (DDP); otherwise a
        step is whole once every rank's directory is committed. `fence`: each commit
        records its world and is refused once a newer world has started (fencing.py).
        `lease`: raises once the rank's lease ran out (the worker client's `check_lease`,
        training/monitor_link/lease.py): no commit to a shared tier after it."""
        self.rank = rank
        self.replicated = replicated
        self.world_size = world_size
        self.job = job
        self.tiers = tiers
        self.threads = threads
        self.sync_files = sync_files
        self.on_committed = on_committed
        self.on_failed = on_failed
        self.fence = fence
        self.lease = lease
        for tier in tiers.stored:
            if lease is not None and tier.fence is not None:
                # Checked before each shared write and again at its commit point: an
                # upload may outlast the lease.
                tier.fence.gate = lease
        #: Every tier's outcome of every save, in order.
        self.results: list[SaveResult] = []
        #: Per tier, the steps emergency saves committed: retention does not count them.
        self.emergency_steps: dict[Tier, set[int]] = {t.kind: set() for t in tiers.stored}
        self._idle = threading.Event()
        self._idle.set()
        #: The step whose later tiers' copies are under way (their own thread), if any.
        self._uploading: int | None = None
        self._uploaded = threading.Event()
        self._uploaded.set()
        self._retention_lock = threading.Lock()  # retention and its emergency steps
        self._lock = threading.Lock()

    def emergency_step(self, kind: Tier, step: int) -> None:
        """Record that an emergency save committed `step` in the tier of `kind` (not
        counted by retention, see `format.beyond_retention`)."""
        with self._retention_lock:
            self.emergency_steps[kind].add(step)

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until the save in flight (if any) and its later tiers' copies are committed or
        failed; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._idle.wait(timeout_s):
            return False
        return self._uploaded.wait(None if deadline is None else deadline - time.monotonic())

    def wait_for_save(self, timeout_s: float | None = None) -> bool:
        """Until the save in flight is written to its first tier (the staging buffers are
        free again); its later copies may still be under way. False on timeout."""
        return self._idle.wait(timeout_s)

    def submit(self, job: SaveJob, *, background: bool) -> None:
        """Run `job` (in a new thread when `background`). The caller has waited for the
        previous one (`wait`)."""
        with self._lock:
            if not self._idle.is_set():
                raise RuntimeError("a save is still being written")
            self._idle.clear()
        job.background = background
        if not background:
            self._run(job)
            return
        threading.Thread(
            target=self._run, args=(job,), name=f"checkpoint-save-{job.step}", daemon=True
        ).start()

    def _due(self, job: SaveJob) -> list[StoredTier]:
        """The stored tiers `job` writes: those due, and those that copy one that is."""
        return [t for t in self.tiers.stored if t.kind in job.kinds or t.follows in job.kinds]

    def _run(self, job: SaveJob) -> None:
        try:
            self._save(job)
        except Exception as exc:  # never kill the training loop for a failed save
            self._failed(job, job.kinds[0], exc)
        finally:
            self._idle.set()

    def _failed(self, job: SaveJob, kind: Tier, exc: BaseException) -> None:
        log.error("checkpoint save of step %d to %s failed: %r", job.step, kind, exc)
        self._report_failed(job, kind, repr(exc))

    def _report_failed(self, job: SaveJob, kind: Tier, error: str, skipped: bool = False) -> None:
        result = SaveResult(
            job.step,
            kind,
            None,
            0,
            job.blocking_s,
            time.monotonic() - job.started,
            error,
            job.emergency,
            skipped=skipped,
            fence=self._fence_mode(kind),
        )
        self.results.append(result)
        if self.on_failed is not None:
            try:
                self.on_failed(result)
            except Exception as report_exc:
                log.warning("checkpoint: reporting a failed save failed: %r", report_exc)

    def _save(self, job: SaveJob) -> None:
        if job.finish_staging is not None:
            job.state = job.finish_staging(job.state)
        writing = time.monotonic()
        first, *rest = self._due(job)
        temp = first.write_dir(job.step, self.rank)
        try:
            writer = SummingFileSystemWriter(
                temp, thread_count=self.threads, sync_files=self.sync_files
            )
            dcp_save(job.state, storage_writer=writer, no_dist=True)
            manifest = fmt.build_manifest(
                temp,
                step=job.step,
                rank=self.rank,
                world_size=self.world_size,
                job=self.job,
                threads=self.threads,
                known=writer.sums,
                world=self.fence.world if self.fence is not None else None,
            )
            if self.fence is not None:
                self.fence.check(first.kind)
            if self.lease is not None and first.shared:
                self.lease(f"the {first.kind} commit of step {job.step}")
            final = first.commit(temp, manifest)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        self._committed(
            SaveResult(
                job.step,
                first.kind,
                final,
                manifest.total_bytes,
                job.blocking_s,
                time.monotonic() - job.started,
                emergency=job.emergency,
                write_s=time.monotonic() - writing,
                first=True,
            )
        )
        if final is not None:
            for follower in self.tiers.followers(first.kind):
                try:
                    follower.save(final, manifest)
                except Exception as exc:  # the first tier holds the step
                    log.warning("checkpoint: %s of step %d: %r", follower.where, job.step, exc)
        if job.emergency:
            # An emergency save adds to the tiers and evicts nothing, nor counts in a later
            # retention: with a sharded state a rank that could not save it (the dead one)
            # needs the periodic step the others still hold. Its later copies are made
            # here: the process may not live to see a thread's.
            self.emergency_step(first.kind, job.step)
            for tier in rest:
                if self._copy(tier, job, final, manifest):
                    self.emergency_step(tier.kind, job.step)
            return
        self.emergency_steps[first.kind].discard(job.step)
        if rest and job.background:
            self._upload(job, rest, final, manifest)
        else:
            for tier in rest:
                if self._copy(tier, job, final, manifest):
                    self._retain(tier, job.step)
        self._retain(first, job.step)

    def _copy(self, tier: StoredTier, job: SaveJob, final: Path | None, manifest: Manifest) -> bool:
        """Copy the step committed in the first tier to `tier`; whether it committed."""
        assert final is not None
        copied_at = time.monotonic()
        try:
            if self.fence is not None:
                self.fence.check(tier.kind)
            if self.lease is not None and tier.shared:
                self.lease(f"the {tier.kind} copy of step {job.step}")
            path = tier.save(final, manifest)
        except Exception as exc:  # the first tier holds the step: only this one failed
            # Nor is retention run there: a rank refused as an older world's must not
            # evict what a newer world keeps.
            self._failed(job, tier.kind, exc)
            return False
        # The loop blocked once, for the first tier's save: a copy adds no blocking.
        seconds = time.monotonic() - copied_at
        self._committed(
            SaveResult(
                job.step, tier.kind, path, manifest.total_bytes, 0.0, seconds, write_s=seconds
            )
        )
        return True

    def _retain(self, tier: StoredTier, step: int) -> None:
        """`tier` committed periodic step `step`: its retention, after its shadowed
        commits are gone (fencing.py); emergency steps are set aside, and the step being
        copied out of it stays."""
        aside = self.emergency_steps[tier.kind]
        with self._retention_lock:  # an emergency save may add to it meanwhile
            aside.discard(step)  # saved again as a periodic step
            emergency = set(aside)
        uploading = self._uploading
        try:
            if self.fence is not None:
                self.fence.drop_shadowed(tier.kind, self.rank)
            removed = tier.retain(
                self.rank,
                tier.keep(self.world_size),
                aside=emergency,
                protect=() if uploading is None else (uploading,),
            )
        except Exception as exc:  # the step is committed: retention runs again next time
            log.warning("checkpoint: %s retention failed: %r", tier.where, exc)
            return
        with self._retention_lock:
            aside -= set(removed)

    def _upload(
        self, job: SaveJob, tiers: list[StoredTier], final: Path | None, manifest: Manifest
    ) -> None:
        """The later tiers' copies in a thread of their own; skipped, and reported, while
        the previous ones are still under way (see the module)."""
        with self._lock:
            busy = self._uploading
            if busy is None:
                self._uploading = job.step
                self._uploaded.clear()
        if busy is not None:
            for tier in tiers:
                error = (
                    f"skipped: the {tier.kind} copy of step {busy} is still under way (a "
                    f"slow bucket); the {job.kinds[0].name} tier keeps step {job.step}"
                )
                log.warning("checkpoint: %s save of step %d %s", tier.kind, job.step, error)
                self._report_failed(job, tier.kind, error, skipped=True)
            return

        def upload() -> None:
            try:
                for tier in tiers:
                    if self._copy(tier, job, final, manifest):
                        self._retain(tier, job.step)
            finally:
                with self._lock:
                    self._uploading = None
                self._uploaded.set()

        threading.Thread(target=upload, name=f"checkpoint-upload-{job.step}", daemon=True).start()

    def publish(self, kind: Tier, step: int) -> None:
        """Write `step`'s global metadata in the tier of `kind` if every rank committed."""
        ranks = [0] if self.replicated else list(range(self.world_size))
        tier = self.tiers.stored_of(kind)
        try:
            if tier is not None:
                tier.publish(step, ranks, sync=self.sync_files)
        except Exception as exc:
            # The step still restores here (the restore merges the ranks' metadata itself).
            log.warning("checkpoint: global metadata of step %d not written: %r", step, exc)

    def _fence_mode(self, kind: Tier) -> str | None:
        tier = self.tiers.stored_of(kind)
        return tier.fence.known_mode if tier is not None and tier.fence is not None else None

    def copy_emergency(
        self, tier: StoredTier, step: int, source: Path, manifest: Manifest
    ) -> str | None:
        """An emergency save's copy of its committed step to `tier`, fenced as every
        commit; the error, reported as a failed save, or None when committed."""
        started = time.monotonic()
        try:
            if self.fence is not None:
                self.fence.check(tier.kind)
            if self.lease is not None and tier.shared:
                self.lease(f"the {tier.kind} copy of emergency step {step}")
            tier.save(source, manifest)
        except Exception as exc:
            job = SaveJob(step, {}, (tier.kind,), 0.0, started, emergency=True)
            self._failed(job, tier.kind, exc)
            return repr(exc)
        self.emergency_step(tier.kind, step)
        return None

    def _committed(self, result: SaveResult) -> None:
        result.fence = self._fence_mode(result.tier)
        self.publish(result.tier, result.step)
        self.results.append(result)
        try:
            self.on_committed(result)
        except Exception as exc:
            log.warning("checkpoint: reporting step %d failed: %r", result.step, exc)

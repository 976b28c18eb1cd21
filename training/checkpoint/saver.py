"""Writes staged states to the tiers, in the background, one save at a time.

A save job: `torch.distributed.checkpoint` writes the staged state into a temporary
directory of the first tier due (RAM, else durable: a directory, or local scratch space
uploaded to a bucket) with `ckpt_threads_per_rank` writer threads, each file checksummed
as it is written (writer.py); the sums go into the manifest and the directory is
committed (by rename; in a bucket, by the manifest uploaded last: durable.py); the host
monitor is asked to copy it to the partner node (peer tier); a durable save then copies
the committed RAM directory (the same files and manifest); retention keeps the newest
checkpoints of each tier. A durable tier that fails (a bucket down past its bounded
retries) fails that save only: it is reported, and the RAM tier keeps the step.

A save due while the previous one is still being written waits for it: the staging
buffers are the previous save's until it is on disk, and skipping a save would silently
widen what a failure loses. The wait counts as blocking time, and is reported.

The durable copy of a step the RAM tier committed is not part of that wait: it runs in
a thread of its own, one upload at a time, so that a slow bucket never holds up the next
save. A durable copy due while the previous one is still under way is skipped (the RAM
tier, and the partner's copy, take that step): reported as a failed save that says so,
and not counted towards `max_consecutive_save_failures` (the bucket works, slowly); the
durable tier's checkpoint age shows it. The step being uploaded stays in RAM until then.
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
from training.checkpoint import global_view
from training.checkpoint.durable import DurableStore
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
    to_ram: bool
    to_durable: bool
    blocking_s: float  # grows if the next optimizer step waits for `finish_staging`
    started: float  # monotonic, when the loop asked for it
    #: Copies what the loop left to copy during its next step (see Checkpointer.save);
    #: run first, in the save's thread.
    finish_staging: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    #: Asked for by the host monitor (reported as the `emergency` tier).
    emergency: bool = False
    #: Written in a thread of its own (`Saver.submit`): its durable copy is too.
    background: bool = False


@dataclass
class SaveResult:
    """One tier's outcome of one save (for reports and tests)."""

    step: int
    tier: str
    path: Path | None
    size: int
    blocking_s: float
    total_s: float
    error: str | None = None
    emergency: bool = False
    #: Of `total_s`, the seconds spent writing to this tier (after the copy to host
    #: memory): what the tier's throughput is measured on.
    write_s: float | None = None
    #: Not attempted: the durable tier's previous upload was still under way.
    skipped: bool = False
    #: A durable commit of a fenced world: how the tier fenced it ("conditional", or
    #: "read-then-write" where the store lacks conditional writes: commit_fence.py).
    fence: str | None = None


class Saver:
    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        job: str | None,
        ram_root: Path | None,
        durable: DurableStore | None,
        threads: int,
        ram_keep: int,
        durable_keep: int,
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
        training/monitor_link/lease.py): no durable commit after it."""
        self.rank = rank
        self.replicated = replicated
        self.world_size = world_size
        self.job = job
        self.ram_root = ram_root
        self.durable = durable
        self.threads = threads
        self.ram_keep = ram_keep
        self.durable_keep = durable_keep
        self.sync_files = sync_files
        self.on_committed = on_committed
        self.on_failed = on_failed
        self.fence = fence
        self.lease = lease
        if lease is not None and durable is not None:
            # Checked before each durable write and again at its commit point: an upload
            # may outlast the lease.
            durable.fence.gate = lease
        #: Every tier's outcome of every save, in order.
        self.results: list[SaveResult] = []
        #: Per tier, the steps emergency saves committed: retention does not count them.
        self.emergency_steps: dict[str, set[int]] = {Tier.RAM: set(), Tier.DURABLE: set()}
        self._idle = threading.Event()
        self._idle.set()
        #: The step whose durable copy is under way (its own thread), if any.
        self._uploading: int | None = None
        self._uploaded = threading.Event()
        self._uploaded.set()
        self._durable_lock = threading.Lock()  # durable retention and its emergency steps
        self._lock = threading.Lock()

    def emergency_step(self, tier: str, step: int) -> None:
        """Record that an emergency save committed `step` in `tier` (not counted by
        retention, see `format.beyond_retention`)."""
        with self._durable_lock:
            self.emergency_steps[tier].add(step)

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until the save in flight (if any) and its durable copy are committed or
        failed; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._idle.wait(timeout_s):
            return False
        return self._uploaded.wait(None if deadline is None else deadline - time.monotonic())

    def wait_for_save(self, timeout_s: float | None = None) -> bool:
        """Until the save in flight is written to its first tier (the staging buffers are
        free again); its durable copy may still be under way. False on timeout."""
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

    def _run(self, job: SaveJob) -> None:
        try:
            self._save(job)
        except Exception as exc:  # never kill the training loop for a failed save
            self._failed(job, Tier.RAM if job.to_ram else Tier.DURABLE, exc)
        finally:
            self._idle.set()

    def _failed(self, job: SaveJob, tier: str, exc: BaseException) -> None:
        log.error("checkpoint save of step %d to %s failed: %r", job.step, tier, exc)
        self._report_failed(job, tier, repr(exc))

    def _report_failed(self, job: SaveJob, tier: str, error: str, skipped: bool = False) -> None:
        result = SaveResult(
            job.step,
            tier,
            None,
            0,
            job.blocking_s,
            time.monotonic() - job.started,
            error,
            job.emergency,
            skipped=skipped,
            fence=self._fence_mode(tier),
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
        first_tier = Tier.RAM if job.to_ram else Tier.DURABLE
        if job.to_ram:
            assert self.ram_root is not None
            temp = fmt.new_temp_dir(self.ram_root, job.step, self.rank)
        else:
            assert self.durable is not None
            temp = self.durable.write_dir(job.step, self.rank)
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
                self.fence.check(first_tier)
            if self.lease is not None and not job.to_ram:
                self.lease(f"the durable commit of step {job.step}")
            final: Path | None
            if job.to_ram:
                assert self.ram_root is not None
                final = fmt.rank_dir(self.ram_root, job.step, self.rank)
                fmt.commit(temp, manifest, final, sync=self.sync_files)
            else:
                assert self.durable is not None
                final = self.durable.commit(temp, manifest)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        self._committed(
            SaveResult(
                job.step,
                first_tier,
                final,
                manifest.total_bytes,
                job.blocking_s,
                time.monotonic() - job.started,
                emergency=job.emergency,
                write_s=time.monotonic() - writing,
            )
        )
        copy = job.to_ram and job.to_durable and self.durable is not None
        if job.emergency:
            # An emergency save adds to the tiers and evicts nothing, nor counts in a later
            # retention: with a sharded state a rank that could not save it (the dead one)
            # needs the periodic step the others still hold. Its durable copy is made
            # here: the process may not live to see a thread's.
            self.emergency_step(Tier.RAM if job.to_ram else Tier.DURABLE, job.step)
            if copy and self._to_durable(job, final, manifest):
                self.emergency_step(Tier.DURABLE, job.step)
            return
        self.emergency_steps[Tier.RAM if job.to_ram else Tier.DURABLE].discard(job.step)
        if copy and not job.background:
            if self._to_durable(job, final, manifest):
                self._after_durable(job.step)
        elif copy:
            self._upload(job, final, manifest)
        elif job.to_durable and self.durable is not None:  # written there first
            self._after_durable(job.step)
        if job.to_ram and self.ram_root is not None:
            # Several ranks keep one step more: a rank killed while writing the newest
            # step, or a node lost while its newest step was still on its way to the
            # partner (whose copy its ranks then restore from), shares only the step
            # before it with the ranks that committed.
            keep = max(self.ram_keep, 2) if self.world_size > 1 else self.ram_keep
            if self.fence is not None:
                self.fence.drop_shadowed(Tier.RAM, self.rank)
            aside = self.emergency_steps[Tier.RAM]
            uploading = self._uploading
            protect = () if uploading is None else (uploading,)
            aside -= set(fmt.retain(self.ram_root, self.rank, keep, protect=protect, aside=aside))

    def _to_durable(self, job: SaveJob, final: Path | None, manifest: Manifest) -> bool:
        """Copy the step committed in RAM to the durable tier; whether it committed."""
        assert final is not None and self.durable is not None
        copied_at = time.monotonic()
        try:
            if self.fence is not None:
                self.fence.check(Tier.DURABLE)
            if self.lease is not None:
                self.lease(f"the durable copy of step {job.step}")
            path = self.durable.copy_committed(final, manifest)
        except Exception as exc:  # the RAM tier holds the step: only durable failed
            # Nor is retention run there: a rank refused as an older world's must not
            # evict what a newer world keeps.
            self._failed(job, Tier.DURABLE, exc)
            return False
        # The loop blocked once, for the RAM save: the durable copy adds no blocking.
        seconds = time.monotonic() - copied_at
        self._committed(
            SaveResult(
                job.step, Tier.DURABLE, path, manifest.total_bytes, 0.0, seconds, write_s=seconds
            )
        )
        return True

    def _after_durable(self, step: int) -> None:
        """The durable tier committed periodic step `step`: its retention."""
        assert self.durable is not None
        aside = self.emergency_steps[Tier.DURABLE]
        with self._durable_lock:  # an emergency save may add to it meanwhile
            aside.discard(step)  # saved again as a periodic step
            emergency = set(aside)
        try:
            if self.fence is not None:
                self.fence.drop_shadowed(Tier.DURABLE, self.rank)
            removed = self.durable.retain(self.rank, self.durable_keep, aside=emergency)
        except Exception as exc:  # the step is committed: retention runs again next time
            log.warning("checkpoint: durable retention failed: %r", exc)
            return
        with self._durable_lock:
            aside -= set(removed)

    def _upload(self, job: SaveJob, final: Path | None, manifest: Manifest) -> None:
        """The durable copy in a thread of its own; skipped, and reported, while the
        previous one is still under way (see the module)."""
        with self._lock:
            busy = self._uploading
            if busy is None:
                self._uploading = job.step
                self._uploaded.clear()
        if busy is not None:
            error = (
                f"skipped: the durable copy of step {busy} is still under way (a slow "
                f"bucket); the RAM tier keeps step {job.step}"
            )
            log.warning("checkpoint: durable save of step %d %s", job.step, error)
            self._report_failed(job, Tier.DURABLE, error, skipped=True)
            return

        def upload() -> None:
            try:
                if self._to_durable(job, final, manifest):
                    self._after_durable(job.step)
            finally:
                with self._lock:
                    self._uploading = None
                self._uploaded.set()

        threading.Thread(target=upload, name=f"checkpoint-upload-{job.step}", daemon=True).start()

    def publish(self, tier: str, step: int) -> None:
        """Write `step`'s global metadata in `tier` if every rank has committed."""
        ranks = [0] if self.replicated else list(range(self.world_size))
        try:
            if tier == Tier.DURABLE and self.durable is not None:
                self.durable.publish(step, ranks, sync=self.sync_files)
            elif tier == Tier.RAM and self.ram_root is not None:
                global_view.publish(self.ram_root, step, ranks, sync=self.sync_files)
        except Exception as exc:
            # The step still restores here (the restore merges the ranks' metadata itself).
            log.warning("checkpoint: global metadata of step %d not written: %r", step, exc)

    def _fence_mode(self, tier: str) -> str | None:
        return self.durable.fence.known_mode if tier == Tier.DURABLE and self.durable else None

    def copy_emergency(self, step: int, source: Path, manifest: Manifest) -> str | None:
        """An emergency save's copy of its RAM step to the durable tier, fenced as every
        durable commit; the error, reported as a failed save, or None when committed."""
        assert self.durable is not None
        started = time.monotonic()
        try:
            if self.fence is not None:
                self.fence.check(Tier.DURABLE)
            if self.lease is not None:
                self.lease(f"the durable copy of emergency step {step}")
            self.durable.copy_committed(source, manifest)
        except Exception as exc:
            job = SaveJob(step, {}, False, True, 0.0, started, emergency=True)
            self._failed(job, Tier.DURABLE, exc)
            return repr(exc)
        self.emergency_step(Tier.DURABLE, step)
        return None

    def _committed(self, result: SaveResult) -> None:
        if result.tier == Tier.DURABLE:
            result.fence = self._fence_mode(Tier.DURABLE)
        self.publish(result.tier, result.step)
        self.results.append(result)
        try:
            self.on_committed(result)
        except Exception as exc:
            log.warning("checkpoint: reporting step %d failed: %r", result.step, exc)

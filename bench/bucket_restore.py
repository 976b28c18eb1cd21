"""A swapped-in spare's restore from the object store, beside its restore from the peer
copy (bench/peer_transfer.py): the same committed rank directory, uploaded to SeaweedFS's
S3 server on loopback through the durable tier, then read back by the durable tier's own
restore path (training/checkpoint/durable.py: the manifest, then every file in parallel
ranges) into the spare's RAM tier and checked there, as a restore checks it. Measured in
the peer rounds' alternation, so that both face the same machine.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from training.checkpoint import CheckpointSettings
from training.checkpoint import durable as durable_tier
from training.checkpoint import format as fmt

#: Parallel requests of one restore: the durable tier's default (ckpt_threads_per_rank 2)
#: gives 2 files x 2 ranges; 4 is a bucket's fair share on a node with several ranks.
THREADS = 4


class BucketRestore:
    """SeaweedFS started for the run, and the durable tier on one bucket of it."""

    def __init__(self, work: Path, scratch: Path) -> None:
        """`work`: the store's volumes (disk); `scratch`: where a restore lands first, on
        the spare's RAM tier's file system (tmpfs), as the peer copy does."""
        from tests.object_store import BUCKET, Seaweed

        # No GET cache: every restore reads the volumes, as from a bucket's disks.
        self.seaweed = Seaweed(
            work / "seaweed",
            volume_size_mb=1024,
            volumes=0,
            extra_args=("-s3.cacheCapacityMB=0",),
            extra_env={"GOMEMLIMIT": "1GiB", "GOGC": "50"},
        )
        self.seaweed.start()
        os.environ.update(self.seaweed.env())  # the standard provider chain reads them
        settings = CheckpointSettings(
            durable_url=f"s3://{BUCKET}/bench",
            in_memory_checkpointing_freq=1,
            s3_checkpointing_freq=1,
            ckpt_threads_per_rank=THREADS,
        )
        store = durable_tier.open_store(settings, scratch=scratch)
        assert store is not None
        self.store = store

    def upload(self, rank_dir: Path, step: int) -> None:
        """The rank directory of `step`, committed to the bucket (not timed)."""
        manifest = fmt.read_manifest(rank_dir, step=step, rank=0)
        self.store.copy_committed(rank_dir, manifest)

    def restore(self, step: int, dest: Path) -> float:
        """Seconds to bring `step` from the bucket into `dest`, checked."""
        started = time.perf_counter()
        staged = self.store.stage(step, 0)
        self.store.fetch(staged)
        target = fmt.rank_dir(dest, step, 0)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(staged, target)
        fmt.verify(target, fmt.read_manifest(target, step=step, rank=0), threads=2)
        seconds = time.perf_counter() - started
        self.store.clear_staged()
        self.store.remove(step, 0)
        return seconds

    def stop(self) -> None:
        self.seaweed.stop()

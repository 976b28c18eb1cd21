"""The NumPy workload's checkpoints fenced by world (the rule: training/checkpoint/fencing.py):
an older world's save is refused once a newer world started in its tier, a restore never
loads a step a newer world's start shadows, a file that names no world loads as before,
and a new run that reuses the tiers goes on as the world after the newest it finds.
In-process, one worker, no cluster."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from training.checkpoint.fencing import StaleWorldCommit, WorldStart, read_local, record_local
from training.npz_format import CHECKPOINT_META, checkpoint_file, read_checkpoint
from training.numpy_workload.checkpoint import CheckpointStore
from training.numpy_workload.config import WorkloadConfig
from training.numpy_workload.fence import TierFence, starts_roots
from training.numpy_workload.model import ShardState
from training.numpy_workload.train import CheckpointSavesRefused, Trainer, _StopFlag
from training.worker_client import CheckpointTier, WorkerClient

DIM = 4


def tiers(root: Path) -> dict[CheckpointTier, Path]:
    return {
        "local": root / "local",
        "durable": root / "durable",
        "emergency": root / "durable" / "emergency",
    }


def store(root: Path, world: int | None, *, shard: int = 0, num_shards: int = 1) -> CheckpointStore:
    dirs = tiers(root)
    fence = TierFence(world, starts_roots(dirs))
    return CheckpointStore(dirs, shard=shard, num_shards=num_shards, keep=3, fence=fence)


def state(step: int, value: float = 1.0) -> ShardState:
    return ShardState(step=step, w=np.full(DIM, value), v=np.zeros(DIM))


def world_of(path: Path) -> int | None:
    data = read_checkpoint(path)
    assert data is not None, path
    return data.world


def test_an_older_worlds_save_is_refused_once_a_newer_world_started(tmp_path: Path) -> None:
    old = store(tmp_path, 1)
    path, _ = old.save(state(5), "durable")
    assert world_of(path) == 1
    record_local(tmp_path / "durable", WorldStart(2, 5))  # a newer world, elsewhere

    for tier in ("durable", "emergency"):  # the emergency tier shares the durable starts
        with pytest.raises(StaleWorldCommit, match=r"world 1.*world 2 has started"):
            old.save(state(10), tier)
    assert not checkpoint_file(tmp_path / "durable", 10, 0, 1).exists()
    assert not checkpoint_file(tmp_path / "durable" / "emergency", 10, 0, 1).exists()
    # This node's local tier has seen no newer start: its saves still go through (no
    # restore ever loads them: they are shadowed by world 2's start from step 5).
    path, _ = old.save(state(10), "local")
    assert world_of(path) == 1
    assert 10 not in old.available([WorldStart(2, 5)])
    # The newer world's own saves are not refused.
    path, _ = store(tmp_path, 2).save(state(10, 2.0), "durable")
    assert world_of(path) == 2


def test_a_shadowed_step_is_never_offered_to_a_restore(tmp_path: Path) -> None:
    old = store(tmp_path, 1)
    for step in (10, 20, 30):
        old.save(state(step), "durable")
    old.save(state(30), "local")
    newer = [WorldStart(1, 0), WorldStart(2, 10)]
    # World 2 started from step 10: world 1's steps after it lie on a dead branch.
    assert sorted(old.available(newer)) == [10]
    assert sorted(old.available()) == [10, 20, 30]  # unfenced, as before

    # A step whose fastest copy is shadowed still comes from a tier whose copy is not.
    store(tmp_path, 2).save(state(30, 2.0), "durable")
    found = old.available(newer)
    assert sorted(found) == [10, 30]
    assert found[30].tier == "durable"
    loaded, _ = old.load(found[30], DIM)
    assert np.array_equal(loaded.w, np.full(DIM, 2.0))


def test_retention_drops_this_shards_shadowed_files_first(tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    for shard in (0, 1):
        store(tmp_path, 1, shard=shard, num_shards=2).save(state(30), "durable")
    record_local(durable, WorldStart(2, 10))
    newer = store(tmp_path, 2, shard=0, num_shards=2)
    newer.save(state(20, 2.0), "durable")
    # Shard 0's step 30 of world 1 is gone; shard 1's file is its own worker's to drop.
    assert not checkpoint_file(durable, 30, 0, 2).exists()
    assert checkpoint_file(durable, 30, 1, 2).exists()
    assert world_of(checkpoint_file(durable, 20, 0, 2)) == 2


def test_a_file_that_names_no_world_loads_as_before(tmp_path: Path) -> None:
    unfenced = CheckpointStore(tiers(tmp_path), shard=0, num_shards=1)  # as written before
    path, _ = unfenced.save(state(10, 3.0), "durable")
    with zipfile.ZipFile(path) as archive:
        assert "world" not in json.loads(archive.read(CHECKPOINT_META))
    assert world_of(path) is None

    reader = store(tmp_path, 0)
    assert sorted(reader.available()) == [10]
    # Older than every world, it is still loaded when no world started before step 10 ...
    found = reader.available([WorldStart(1, 10)])
    loaded, _ = reader.load(found[10], DIM)
    assert np.array_equal(loaded.w, np.full(DIM, 3.0))
    # ... and shadowed by any world that started from an earlier step.
    assert reader.available([WorldStart(0, 5)]) == {}


def config(root: Path, **env: str) -> WorkloadConfig:
    return WorkloadConfig.from_env(
        {
            "RUN_DIR": str(root / "run"),
            "LOCAL_CKPT_DIR": str(root / "local"),
            "DURABLE_CKPT_DIR": str(root / "durable"),
            "MODEL_DIM": str(DIM),
            "STEP_TIME_S": "0",
            **env,
        }
    )


class Client(WorkerClient):
    """Offline, and keeps what the workload reports."""

    def __init__(self) -> None:
        super().__init__(0, 0)
        self.failed: list[tuple[int, str, str]] = []
        self.saved: list[tuple[int, str]] = []

    def report_checkpoint_failed(
        self, step: int, tier: CheckpointTier, error: str, *, total_s: float | None = None
    ) -> None:
        self.failed.append((step, tier, error))

    def report_checkpoint_saved(
        self,
        step: int,
        duration_s: float,
        tier: CheckpointTier,
        *,
        size_bytes: int | None = None,
        total_s: float | None = None,
    ) -> None:
        self.saved.append((step, tier))


def trainer(root: Path, **env: str) -> tuple[Trainer, Client]:
    client = Client()
    return Trainer(config(root, **env), client, _StopFlag()), client


@pytest.mark.parametrize("attempt", ["0", ""])
def test_a_new_run_goes_on_as_the_world_after_the_newest_start(
    tmp_path: Path, attempt: str
) -> None:
    """A job made again counts its attempts from 0 (or counts none) on tiers an earlier
    run fenced up to world 3: it restores its checkpoints and writes as world 4."""
    earlier = store(tmp_path, 3)
    earlier.save(state(10, 5.0), "durable")
    record_local(tmp_path / "durable", WorldStart(3, 0))

    job, client = trainer(tmp_path, WORKLOAD_ATTEMPT=attempt)
    resumed = job.resume()
    assert resumed.step == 10 and np.array_equal(resumed.w, np.full(DIM, 5.0))
    assert job.fence.world == 4
    assert WorldStart(4, 10) in read_local(tmp_path / "durable")
    assert WorldStart(4, 10) in read_local(tmp_path / "local")
    job.save(state(20), "durable")
    assert client.failed == [] and client.saved == [(20, "durable")]
    assert world_of(checkpoint_file(tmp_path / "durable", 20, 0, 1)) == 4


def test_a_world_at_the_newest_start_keeps_its_number(tmp_path: Path) -> None:
    record_local(tmp_path / "durable", WorldStart(3, 0))
    job, _ = trainer(tmp_path, WORKLOAD_ATTEMPT="5")
    assert job.resume().step == 0
    assert job.fence.world == 5
    assert read_local(tmp_path / "durable") == [WorldStart(3, 0), WorldStart(5, 0)]


def test_refused_saves_are_reported_and_stop_the_worker(tmp_path: Path) -> None:
    job, client = trainer(tmp_path, WORKLOAD_ATTEMPT="1", MAX_CONSECUTIVE_SAVE_FAILURES="2")
    job.state = job.resume()
    assert job.fence.world == 1
    job.save(state(5), "durable")
    # Cut off, this worker trains on while world 2 starts from step 5 elsewhere.
    record_local(tmp_path / "durable", WorldStart(2, 5))
    job.save(state(10), "durable")
    job.check_refusals()  # one refusal: not yet
    job.save(state(10), "local")  # another tier's success does not reset the count
    with pytest.raises(StaleWorldCommit):
        job.emergency_checkpoint()  # its ack must say it failed
    job.save(state(20), "durable")
    assert [(step, tier) for step, tier, _ in client.failed] == [
        (10, "durable"),
        (0, "emergency"),
        (20, "durable"),
    ]
    assert all(error.startswith("StaleWorldCommit: ") for _, _, error in client.failed)
    with pytest.raises(CheckpointSavesRefused, match="2 checkpoint saves in a row to the dur"):
        job.check_refusals()


def test_no_bound_when_it_is_zero(tmp_path: Path) -> None:
    job, client = trainer(tmp_path, WORKLOAD_ATTEMPT="1", MAX_CONSECUTIVE_SAVE_FAILURES="0")
    job.state = job.resume()
    record_local(tmp_path / "durable", WorldStart(2, 0))
    for step in (10, 20, 30, 40):
        job.save(state(step), "durable")
    job.check_refusals()
    assert len(client.failed) == 4

"""The durable tier's commit fence (training/checkpoint/commit_fence.py), per store: a
directory, S3 on SeaweedFS, GCS on fake-gcs-server.

An older world's writer commits step 6 through a store of its own, as its process would;
a newer world's restore (the fence, then the listing, then its start) runs on a store of
its own at one point of that commit, between each of its steps. Wherever the newer world
comes before the commit point, the older writer's commit fails (StaleWorldCommit) and no
restore after ever sees its step 6; where it comes after, the commit stands and the newer
world continues from it. Then the step's `.metadata`, `consolidate`, and a store without
conditional writes (an S3 proxy that drops the conditional headers).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from resiliency_protocol.checkpoint_manifest import Manifest
from tests.object_store import BUCKET, FakeGcs, FaultProxy, Seaweed
from training.checkpoint import commit_fence, fencing, global_view
from training.checkpoint import format as fmt
from training.checkpoint.durable import DurableStore, open_store
from training.checkpoint.fencing import StaleWorldCommit, WorldStart
from training.checkpoint.settings import CheckpointSettings

Opener = Callable[[], DurableStore]


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    pytest.importorskip("obstore")
    server = Seaweed(tmp_path_factory.mktemp("seaweed"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGcs]:
    pytest.importorskip("google.cloud.storage")
    server = FakeGcs(tmp_path_factory.mktemp("gcs"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(params=["path", "s3", "gcs"])
def tier(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> CheckpointSettings:
    """The durable tier's settings, each store kind in turn."""
    if request.param == "path":
        return CheckpointSettings(durable_dir=tmp_path / "durable", sync_files=False)
    if request.param == "s3":
        for key, value in request.getfixturevalue("seaweed").env().items():
            monkeypatch.setenv(key, value)
        url = f"s3://{BUCKET}/fence/{tmp_path.name}"
    else:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", request.getfixturevalue("gcs").endpoint)
        url = f"gs://{BUCKET}/fence/{tmp_path.name}"
    return CheckpointSettings(durable_url=url, durable_timeout_s=10.0, sync_files=False)


@pytest.fixture
def opener(tier: CheckpointSettings, tmp_path: Path) -> Opener:
    """Opens the durable tier afresh each call: each store is one process's."""

    def open_() -> DurableStore:
        store = open_store(tier, scratch=tmp_path / "scratch")
        assert store is not None
        return store

    return open_


def in_world(store: DurableStore, world: int, rank: int = 0) -> DurableStore:
    store.fence.world, store.fence.rank = world, rank
    return store


def ram_step(ram: Path, step: int, rank: int, world: int) -> tuple[Path, Manifest]:
    """A committed RAM directory of `rank` at `step`, as a save leaves it."""
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    temp = fmt.new_temp_dir(ram, step, rank)
    state = {f"w{rank}": torch.full((64,), float(step)), "step": step}
    dcp_save(state, storage_writer=FileSystemWriter(temp, sync_files=False), no_dist=True)
    manifest = fmt.build_manifest(temp, step=step, rank=rank, world_size=2, job=None, world=world)
    final = fmt.rank_dir(ram, step, rank)
    fmt.commit(temp, manifest, final, sync=False)
    return final, manifest


def restore(store: DurableStore, world: int, rank: int) -> int:
    """A newer world's restore, as Checkpointer.restore orders it: the fence first, then
    the newest step it admits, then its start."""
    in_world(store, world, rank)
    store.fence.fence(world, 0, 1)
    admitted = [
        step
        for step in store.committed_steps(rank)
        if not store.fenced_out(store.manifest(step, rank))
    ]
    starts = store.starts()
    admitted = [
        s for s in admitted if not fencing.shadowed(store.manifest(s, rank).world, s, starts)
    ]
    start = max(admitted, default=0)
    store.record_start(WorldStart(world, start))
    return start


#: Where the newer world's restore runs, in order along the older writer's commit.
POINTS = ["before", "record made", "begun", "files written", "manifest written", "committed"]


def hooked(
    store: DurableStore, point: str, newer: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run `newer` at `point` of `store`'s next commit (the points past the commit call
    itself are the caller's)."""

    def after(owner: Any, name: str, when: Callable[..., bool] = lambda *a: True) -> None:
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                if when(*args):
                    newer()

        monkeypatch.setattr(owner, name, wrapper)

    def before(owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            newer()
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    if point == "record made":
        after(store.fence.records, "create", lambda name, *_: name.startswith(commit_fence.COMMITS))
    elif point == "begun":
        after(store.fence, "begin")
    elif point == "files written":
        if store.root is not None:  # the directory is renamed into place by format.commit
            before(fmt, "commit")
        else:
            before(store, "_put_manifest")
    elif point == "manifest written":
        before(store.fence, "advance")


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("first", [False, True], ids=["later-commit", "first-commit"])
def test_an_older_writer_loses_to_a_newer_worlds_fence_at_every_point(
    opener: Opener, tmp_path: Path, point: str, first: bool
) -> None:
    """`first`: the racing commit is the older world's first of its rank (its commit
    record does not exist yet when the newer world lists them) or a later one."""
    ram = tmp_path / "ram"
    rank = 1 if first else 0
    earlier = in_world(opener(), 1, 0)
    for step in (2, 4):
        earlier.copy_committed(*ram_step(ram, step, 0, 1))
    # The racing writer: a process of world 1 (its first commit of this store).
    old = in_world(opener(), 1, rank)
    restored: list[int] = []

    def newer() -> None:
        if not restored:
            restored.append(restore(opener(), 2, rank))

    assert earlier.fence.mode == "conditional"  # each of these stores does it
    source, manifest = ram_step(ram, 6, rank, 1)
    if point == "before":
        newer()
    with pytest.MonkeyPatch.context() as hooks:
        hooked(old, point, newer, hooks)
        if point == "committed":
            old.copy_committed(source, manifest)
            newer()
            assert restored == [6]  # the commit came first: the newer world goes on from it
            assert not opener().fenced_out(manifest)
            return
        with pytest.raises(StaleWorldCommit, match="world 2 has started"):
            old.copy_committed(source, manifest)
    assert restored == [4 if rank == 0 else 0], restored
    # The older writer's step 6 is gone, and no restore after sees it.
    assert 6 not in opener().committed_steps(rank)
    assert restore(opener(), 3, rank) == restored[0]
    # Its next commit is refused before anything is uploaded.
    later_source, later = ram_step(ram, 8, rank, 1)
    with pytest.raises(StaleWorldCommit):
        old.copy_committed(later_source, later)
    assert 8 not in opener().committed_steps(rank)


def test_the_steps_metadata_and_consolidate_are_fenced(opener: Opener, tmp_path: Path) -> None:
    ram = tmp_path / "ram"
    old = in_world(opener(), 1, 0)
    for rank in (0, 1):
        old.copy_committed(*ram_step(ram, 2, rank, 1))
    assert old.publish(2, [0, 1], sync=False)
    source, manifest = ram_step(ram, 4, 0, 1)
    old.copy_committed(source, manifest)
    other = in_world(opener(), 1, 1)
    other.copy_committed(*ram_step(ram, 4, 1, 1))
    restore(opener(), 2, 0)
    # World 1's rank 0 writes step 4's global metadata after world 2 fenced: refused.
    with pytest.raises(StaleWorldCommit):
        old.publish(4, [0, 1], sync=False)
    if old.root is not None:
        assert not (fmt.step_dir(old.root, 4) / global_view.METADATA).exists()
        with pytest.raises(StaleWorldCommit):
            global_view.consolidate(fmt.step_dir(old.root, 4), fence=old.fence)
        assert not (fmt.step_dir(old.root, 4) / global_view.METADATA).exists()
        # A job without worlds (or a tool) consolidates as before.
        assert global_view.consolidate(fmt.step_dir(old.root, 4)) == [0, 1]
    else:
        assert old.bucket.size(f"step-0000000004/{global_view.METADATA}") is None  # type: ignore[attr-defined]


def test_a_job_without_worlds_writes_no_records(opener: Opener, tmp_path: Path) -> None:
    store = opener()
    store.copy_committed(*ram_step(tmp_path / "ram", 2, 0, 1))
    assert store.committed_steps(0) == [2]
    assert store.fence.known_mode is None
    assert store.fence.records.names(commit_fence.COMMITS) == []
    assert store.fence.recorded_world() is None


def test_a_store_without_conditional_writes_falls_back_loudly(
    seaweed: Seaweed,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An S3-compatible server that ignores `If-None-Match` and `If-Match` (a proxy drops
    them on the way to SeaweedFS): the tier says so once, and commits as it can."""
    proxy = FaultProxy(seaweed.endpoint, lambda method, path: "unconditional")
    try:
        for key, value in seaweed.env(proxy.endpoint).items():
            monkeypatch.setenv(key, value)
        url = f"s3://{BUCKET}/fence/{tmp_path.name}"
        settings = CheckpointSettings(durable_url=url, durable_timeout_s=10.0)
        caplog.set_level(logging.WARNING)
        store = open_store(settings)
        assert store is not None
        in_world(store, 1)
        store.copy_committed(*ram_step(tmp_path / "ram", 2, 0, 1))
        assert store.fence.mode == "read-then-write"
        assert store.fence.known_mode == "read-then-write"
        store.copy_committed(*ram_step(tmp_path / "ram", 4, 0, 1))
        assert caplog.text.count("does not honour conditional writes") == 1
        # The read before the write still refuses a writer that a newer world fenced.
        newer = open_store(settings)
        assert newer is not None
        assert restore(newer, 2, 0) == 4
        with pytest.raises(StaleWorldCommit):
            store.copy_committed(*ram_step(tmp_path / "ram", 6, 0, 1))
        assert proxy.count("unconditional") > 0
    finally:
        proxy.close()


def test_the_emergency_copy_from_ram_is_fenced(
    tier: CheckpointSettings, opener: Opener, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank of world 1 holds step 6 in RAM only (durable every 4 steps) when a newer
    world fences the tier; the host monitor then asks it for an emergency save: its copy
    of step 6 to the durable tier is refused, and reported as a failed save."""
    import torch

    from training.checkpoint import Checkpointer
    from training.checkpoint.emergency import EmergencyCheckpointError
    from training.checkpoint.peer import PeerTier

    monkeypatch.setenv("WORKLOAD_ATTEMPT", "1")
    settings = dataclasses.replace(
        tier,
        in_memory_checkpointing_freq=2,
        s3_checkpointing_freq=4,
        ram_dir=tmp_path / "ram",
        enable_async_ckpt=False,
        enable_peer_ckpt=False,
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(
        model,
        optimizer,
        settings=settings,
        peer=PeerTier(None, None, 0, fetch_timeout_s=1),
        emergency=True,
    )
    assert ckpt.restore() == 0
    for step in range(1, 7):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        ckpt.step_done(step)
    ckpt.wait()
    assert opener().committed_steps(0) == [4]
    assert restore(opener(), 2, 0) == 4
    with pytest.raises(EmergencyCheckpointError, match="world 2 has started"):
        ckpt.emergency_save()
    failed = ckpt.save_results[-1]
    assert (failed.step, failed.tier, failed.emergency) == (6, "durable", True)
    assert failed.error is not None and "StaleWorldCommit" in failed.error
    assert failed.fence == "conditional"
    assert opener().committed_steps(0) == [4]
    ckpt.close()


def test_a_lease_that_ran_out_during_the_upload_refuses_the_commit_point(
    opener: Opener, tmp_path: Path
) -> None:
    """The rank's lease (training/monitor_link/lease.py) is asked before each durable write
    and again at the commit point, the fence's gate: a lease that ran out while the files
    were uploading refuses the commit, its manifest goes, and no restore sees the step."""
    from training.monitor_link.lease import HostLeaseExpired

    ram = tmp_path / "ram"
    writer = in_world(opener(), 1)
    asked: list[str] = []
    writer.fence.gate = asked.append  # the lease holds: each commit point asks it
    writer.copy_committed(*ram_step(ram, 4, 0, world=1))

    def ran_out(what: str) -> None:
        raise HostLeaseExpired(f"no contact with the supervisor: {what} refused")

    writer.fence.gate = ran_out
    with pytest.raises(HostLeaseExpired, match="step 6"):
        writer.copy_committed(*ram_step(ram, 6, 0, world=1))
    assert asked == ["the durable commit of step 4"]
    reader = opener()
    assert reader.committed_steps(0) == [4]
    assert restore(reader, 2, 0) == 4

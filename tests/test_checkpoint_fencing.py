"""Fencing of the checkpoint tiers between worlds (training/checkpoint/fencing.py), with
real training processes (tests/fencing_writer.py), each a node of its own (its own RAM
tier) sharing one durable tier: a directory, SeaweedFS's S3 server, fake-gcs-server.

The partition: a world-1 writer is cut off and trains on. Its durable save of step 6
passes its read of the starts before world 2 starts, and goes on to commit after world 2
has restored step 4. The tier's commit fence (commit_fence.py) refuses it: a failed
save, and the later ones too, until the writer stops; World 3 restores step 4. The
interleavings of each step of a commit with a newer world's fence are
tests/test_checkpoint_commit_fence.py's.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from resiliency_protocol.checkpoint_manifest import Manifest
from tests.forked_ranks import RankProcess, log_path, start_rank
from tests.object_store import BUCKET, FakeGcs, Seaweed
from training.checkpoint import fencing
from training.checkpoint import format as fmt
from training.checkpoint.durable import DurableStore, open_store
from training.checkpoint.settings import CheckpointSettings

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    pytest.importorskip("obstore")
    server = Seaweed(tmp_path_factory.mktemp("seaweed"))
    server.start()
    yield server
    server.stop()


class Durable:
    """Where the processes' durable tier is, and a store to look into it from here."""

    def __init__(self, args: list[str], env: dict[str, str], store: DurableStore) -> None:
        self.args, self.env, self.store = args, env, store


@pytest.fixture(scope="module")
def gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGcs]:
    pytest.importorskip("google.cloud.storage")
    server = FakeGcs(tmp_path_factory.mktemp("gcs"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(params=["path", "s3", "gcs"])
def durable(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Durable:
    if request.param == "path":
        root = tmp_path / "durable"
        store = open_store(CheckpointSettings(durable_dir=root, sync_files=False))
        assert store is not None
        return Durable(["--durable-dir", str(root)], {}, store)
    if request.param == "gcs":
        server: FakeGcs = request.getfixturevalue("gcs")
        url = f"gs://{BUCKET}/fencing/{tmp_path.name}"
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.endpoint)
        store = open_store(CheckpointSettings(durable_url=url, durable_timeout_s=10.0))
        assert store is not None
        return Durable(["--durable-url", url], {"STORAGE_EMULATOR_HOST": server.endpoint}, store)
    seaweed: Seaweed = request.getfixturevalue("seaweed")
    url = f"s3://{BUCKET}/fencing/{tmp_path.name}"
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    store = open_store(CheckpointSettings(durable_url=url, durable_timeout_s=10.0))
    assert store is not None
    return Durable(["--durable-url", url], seaweed.env(), store)


def writer(world: int | None, ram: Path, durable: Durable, until: int, *extra: str) -> RankProcess:
    """A writer process in `world` (None: it tells none, as under plain torchrun), its
    output in a log beside its RAM tier."""
    env = {**os.environ, **durable.env, "PYTHONPATH": str(ROOT)}
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    env.pop("WORKLOAD_ATTEMPT", None)
    if world is not None:
        env["WORKLOAD_ATTEMPT"] = str(world)
    argv = ["--ram", str(ram), *durable.args, "--until", str(until), *extra]
    return start_rank("tests.fencing_writer", env, log_path(ram.parent / "logs", 0), argv)


def finished(process: RankProcess) -> dict[str, Any]:
    out, _ = process.communicate(timeout=DEADLINE_S)
    assert process.returncode == 0, out[-3000:]
    # Its one JSON line, among the log lines written beside it.
    line = next(line for line in reversed(out.splitlines()) if line.startswith("{"))
    result: dict[str, Any] = json.loads(line)
    return result


def wait_for(path: Path, process: RankProcess) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not path.exists():
        if process.poll() is not None:
            out, _ = process.communicate()
            pytest.fail(f"the writer ended before {path.name}: {out[-3000:]}")
        assert time.monotonic() < deadline, f"no {path.name} within {DEADLINE_S}s"
        time.sleep(0.05)


def test_an_older_worlds_later_commit_is_refused_and_never_restored(
    tmp_path: Path, durable: Durable
) -> None:
    signals = tmp_path / "signals"
    signals.mkdir()
    store = durable.store
    # World 1 trains, is cut off, and holds its durable commit of step 6 past its check.
    old = writer(1, tmp_path / "ram-1", durable, 12, "--hold-at", "6", "--signals", str(signals))
    try:
        wait_for(signals / "held-check", old)
        assert store.committed_steps(0) == [2, 4]
        # World 2 starts on another node: it fences the tier, restores step 4 and records
        # its start.
        second = finished(writer(2, tmp_path / "ram-2", durable, 5))
        assert (second["world"], second["restored"], second["tier"]) == (2, 4, "durable")
        assert fencing.WorldStart(2, 4) in store.starts()
        # The cut-off writer goes on with its commit of step 6, after that start: refused.
        (signals / "go-check").touch()
        (signals / "go-retain").touch()
        stale = finished(old)
    finally:
        if old.poll() is None:
            old.kill()
            old.communicate()
    assert stale["restored"] == 0 and stale["world"] == 1
    refused = [(step, error) for step, tier, error in stale["saves"] if tier == "durable" and error]
    assert [step for step, _ in refused] == [6, 8]
    assert all("StaleWorldCommit" in e and "world 2 has started" in e for _, e in refused), refused
    assert stale["stopped"] is not None and "durable" in stale["stopped"]
    # Its step 6 never counted: world 3 restores step 4, as world 2 did.
    assert store.committed_steps(0) == [2, 4]
    third = finished(writer(3, tmp_path / "ram-3", durable, 4))
    assert (third["restored"], third["tier"]) == (4, "durable")
    assert third["weights"] == second["weights"]
    assert all(store.manifest(s, 0).world == 1 for s in (2, 4))


def test_the_rule() -> None:
    starts = [fencing.WorldStart(2, 60), fencing.WorldStart(3, 80)]
    assert not fencing.shadowed(1, 60, starts)  # what world 2 started from
    assert fencing.shadowed(1, 70, starts)  # world 1 went on after world 2 started
    assert fencing.shadowed(None, 70, starts)  # no world: older than any
    assert not fencing.shadowed(2, 80, starts)
    assert fencing.shadowed(2, 90, starts)  # world 3 started from 80
    assert not fencing.shadowed(3, 200, starts)
    assert fencing.WorldStart.parse(fencing.WorldStart(7, 12).name) == fencing.WorldStart(7, 12)
    assert fencing.WorldStart.parse("world-x-from-1") is None
    manifest = Manifest(step=4, rank=0, world_size=1, files={}, created=0.0, world=5)
    assert Manifest.parse(manifest.to_json()).world == 5
    assert "world" not in json.loads(manifest.model_copy(update={"world": None}).to_json())


#: The store's own fence is the first test's, on every store; what the next two test (the
#: RAM tier's starts, a new run's adoption) is the same on any, so they skip GCS.
ANY_STORE = pytest.mark.parametrize("durable", ["path", "s3"], indirect=True)


@ANY_STORE
def test_a_cut_off_nodes_ram_tier_is_fenced_by_the_starts_of_the_others(
    tmp_path: Path, durable: Durable
) -> None:
    """The RAM tier is the node's own: a newer world's start may be recorded only in the
    durable tier and in other nodes' RAM. The ranks' restore applies every start any of
    them sees, so a commit of an older world in one node's RAM is shadowed too."""
    node_x, node_y = tmp_path / "ram-x", tmp_path / "ram-y"
    signals = tmp_path / "signals"
    signals.mkdir()
    # World 1 trains on node X; it commits step 6 to its RAM and holds in its durable copy
    # (cut off, training on).
    stale = writer(1, node_x, durable, 6, "--hold-at", "6", "--signals", str(signals))
    try:
        wait_for(signals / "held-check", stale)
        assert 6 in fmt.committed_steps(node_x, 0)
        # World 2 starts on node Y from step 4 (the newest step in the durable tier).
        second = finished(writer(2, node_y, durable, 5))
        assert (second["restored"], second["tier"]) == (4, "durable")
        (signals / "go-check").touch()
        (signals / "go-retain").touch()
        result = finished(stale)
    finally:
        if stale.poll() is None:
            stale.kill()
            stale.wait()
    # Its RAM commit of 6 is there (its durable one raced world 2's start: shadowed).
    saves = {(step, tier): error for step, tier, error in result["saves"]}
    assert saves[(6, "ram")] is None
    assert fmt.committed_steps(node_x, 0) == [6]
    assert fmt.read_manifest(fmt.rank_dir(node_x, 6, 0)).world == 1
    # World 3 gets node X back: its RAM step 6 of world 1 is shadowed by world 2's start,
    # recorded in the durable tier and node Y's RAM only.
    third = finished(writer(3, node_x, durable, 4))
    assert (third["restored"], third["tier"]) == (4, "durable")
    assert third["weights"] == second["weights"]


@ANY_STORE
def test_a_new_run_with_its_attempts_counted_again_resumes_and_saves(
    tmp_path: Path, durable: Durable
) -> None:
    """A job run again on the same tiers (a JobSet made again, a second `supervisor run`)
    counts its attempts from 0 again, or not at all (plain torchrun): it is no older world
    but a new run, which resumes from the newest step and whose commits count."""
    first = finished(writer(3, tmp_path / "ram-1", durable, 6))
    assert first["world"] == 3 and not any(error for _, _, error in first["saves"])
    again = finished(writer(0, tmp_path / "ram-2", durable, 10))
    assert (again["restored"], again["world"]) == (6, 4), again
    assert again["stopped"] is None
    assert [(step, error) for step, tier, error in again["saves"] if tier == "durable"] == [
        (8, None),
        (10, None),
    ]
    untold = finished(writer(None, tmp_path / "ram-2", durable, 12))
    assert (untold["restored"], untold["world"]) == (10, 5), untold
    assert not any(error for _, _, error in untold["saves"])
    # What they committed is what the next run restores (not shadowed by the first run's
    # starts).
    last = finished(writer(0, tmp_path / "ram-3", durable, 12))
    assert (last["restored"], last["world"]) == (12, 6), last

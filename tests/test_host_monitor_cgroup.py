"""A host monitor in a memory cgroup smaller than the partner copy it receives.

tmpfs pages are charged to the memory cgroup of the process that writes them: a host
monitor that wrote its partner's copies into /dev/shm under a small limit would be
OOM-killed by the first large copy, and the node's heartbeats would die with it. Partner
copies live on a node-local disk directory instead (the page cache of a file on disk is
reclaimed under the limit), or on tmpfs capped by `peer_store_max_bytes` with the limit
sized to it (host_monitor/README.md, "Where partner copies live"). Both are driven here
for real: real `host-monitor` processes, a real supervisor receiving the heartbeats, and
a memory cgroup (v1 where the machine has it, else v2) that the test makes and removes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.test_host_monitor import WORKER_TOKEN, Cluster, Supervisor, supervisor, wait_for
from tests.test_host_monitor_peer import JOB, PEER_TOKEN, Node, make_checkpoint
from training.checkpoint.peer import PeerTier as WorkerPeerTier

__all__ = ["supervisor"]  # the module's fixture, used here

MiB = 1024 * 1024
V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


class MemoryCgroup:
    """A memory cgroup of our own: v1 (memory controller hierarchy) or v2 (unified)."""

    def __init__(self, path: Path, v1: bool) -> None:
        self.path = path
        self.v1 = v1

    @classmethod
    def make(cls) -> MemoryCgroup:
        name = f"peer-store-test-{uuid.uuid4().hex[:8]}"
        if (V1 / "memory.limit_in_bytes").exists():
            root, v1 = V1, True
        elif "memory" in _read(V2 / "cgroup.controllers").split():
            root, v1 = V2, False
        else:
            pytest.skip("no memory cgroup controller (neither v1 nor v2) on this machine")
        path = root / name
        try:
            path.mkdir()
            if not v1 and not (path / "memory.max").exists():
                path.rmdir()
                pytest.skip("cgroup v2: the memory controller is not enabled for children")
        except OSError as exc:
            pytest.skip(f"cannot make a memory cgroup under {root}: {exc}")
        return cls(path, v1)

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def limit(self, size: int) -> None:
        (self.path / ("memory.limit_in_bytes" if self.v1 else "memory.max")).write_text(str(size))

    def usage(self) -> int:
        return int(_read(self.path / ("memory.usage_in_bytes" if self.v1 else "memory.current")))

    def hits(self) -> int:
        """Times the usage reached the limit (and had to be reclaimed)."""
        if self.v1:
            return int(_read(self.path / "memory.failcnt"))
        return self._counter("memory.events", "max")

    def oom_kills(self) -> int:
        return self._counter("memory.oom_control" if self.v1 else "memory.events", "oom_kill")

    def _counter(self, file: str, key: str) -> int:
        for line in _read(self.path / file).splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
        return 0

    def remove(self) -> None:
        parent = self.path.parent / "cgroup.procs"
        for pid in _read(self.path / "cgroup.procs").split():
            with contextlib.suppress(OSError):  # gone meanwhile
                parent.write_text(pid)
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:  # the last process is still leaving
                time.sleep(0.1)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@pytest.fixture
def shm() -> Iterator[Path]:
    """A directory on tmpfs (/dev/shm), removed after."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm (tmpfs) on this machine")
    path = Path("/dev/shm") / f"peer-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def cgroup() -> Iterator[MemoryCgroup]:
    group = MemoryCgroup.make()
    try:
        yield group
    finally:
        group.remove()


def _node(
    cluster: Cluster,
    name: str,
    store: Path | None = None,
    root: Path | None = None,
    **flags: object,
) -> Node:
    """A host monitor with the peer tier on (as tests/test_host_monitor_peer.py starts
    them); its copies in `store`, else on disk under the test's directory; its workers'
    RAM tier `root`, else there too."""
    root = root or cluster.tmp / name / "ram"
    root.mkdir(parents=True)
    store = store or cluster.tmp / name / "peer"
    agent = cluster.start_agent(
        flags.pop("supervisor_url", None),  # type: ignore[arg-type]
        node=name,
        env={"HOST_MONITOR_PEER_TOKEN": PEER_TOKEN},
        initial_state="running",
        job=JOB,
        checkpoint_root=root,
        peer_store_dir=store,
        peer_timeout_s=30,
        fresh=True,  # its memory is what is measured
        **flags,
    )
    return Node(agent, root, store)


def _pushed(node: Node, step: int, within: float) -> dict[str, Any]:
    def finished() -> dict[str, Any] | None:
        state = node.push_state(0)
        return state if state["step"] == step and state["state"] in ("done", "failed") else None

    return wait_for(finished, within, f"push of step {step}")  # type: ignore[no-any-return]


def _payload(size: int, salt: int) -> bytes:
    block = bytes((i * 31 + salt) % 251 for i in range(MiB))
    return block * (size // MiB)


def _heartbeats_after(sup: Supervisor, node: str, moment: datetime) -> None:
    def newer() -> bool:
        seen = (sup.node(node) or {}).get("last_heartbeat")
        return seen is not None and datetime.fromisoformat(seen) > moment

    wait_for(newer, 15, f"a heartbeat of {node} after the transfer")


def _limit_above_base(group: MemoryCgroup, headroom: int) -> int:
    """Limit the cgroup to what the host monitor uses now, plus `headroom`."""
    limit = (group.usage() // MiB + 1) * MiB + headroom
    group.limit(limit)
    return limit


def test_a_copy_larger_than_the_limit_lands_on_disk_and_the_monitors_live(
    supervisor: Supervisor, cgroup: MemoryCgroup, tmp_path: Path, shm: Path
) -> None:
    cluster = Cluster(tmp_path)
    try:
        # tmp_path is on the machine's disk, as the chart's node-local store directory is.
        a = _node(cluster, "node-a")
        b = _node(cluster, "node-b", supervisor_url=supervisor.url)
        # The spare's RAM tier on tmpfs, as on a real node.
        s = _node(cluster, "node-s", root=shm / "ram")
        a.set_partner(b)
        s.set_partner(b)
        cgroup.add(b.agent.proc.pid)
        _heartbeats_after(supervisor, "node-b", datetime.now(UTC))
        limit = _limit_above_base(cgroup, 64 * MiB)
        size = 3 * limit // MiB // 2 * MiB  # two files, together three times the limit
        files = {"__0_0.distcp": _payload(size, 1), "__1_0.distcp": _payload(size, 2)}
        saved = make_checkpoint(a.root / "tier", 40, 0, files)

        a.replicate(0, 40, saved)
        state = _pushed(a, 40, 120)
        assert state["state"] == "done", state
        moved = datetime.now(UTC)
        assert b.agent.proc.poll() is None, b.agent.log.read_text()[-3000:]
        assert cgroup.oom_kills() == 0
        # The limit was reached, and reclaimed from: the copy did not fit in memory.
        assert cgroup.hits() > 0 and cgroup.usage() <= limit
        _heartbeats_after(supervisor, "node-b", moved)

        # The copy is whole: a spare restores it, every file checked against its manifest.
        # The spare's host monitor is in the cgroup too: it relays the files to the rank,
        # whose memory (its RAM tier is tmpfs) they are charged to.
        cgroup.add(s.agent.proc.pid)
        worker = WorkerPeerTier(s.url, WORKER_TOKEN, 0, fetch_timeout_s=120)
        try:
            fetched = worker.fetch(40, s.root / "tier")
        finally:
            worker.close()
        assert fetched is not None
        restored, verified = fetched
        assert verified
        for name, data in files.items():
            assert (restored / name).read_bytes() == data, name
        assert s.agent.proc.poll() is None and b.agent.proc.poll() is None
        assert cgroup.oom_kills() == 0
        assert (b.store / JOB / "rank-0" / "step-0000000040").is_dir()
    finally:
        cluster.teardown()


def test_on_tmpfs_the_store_cap_refuses_a_copy_the_limit_cannot_hold(
    supervisor: Supervisor, cgroup: MemoryCgroup, tmp_path: Path, shm: Path
) -> None:
    store = shm / "peer"
    cluster = Cluster(tmp_path)
    try:
        a = _node(cluster, "node-a")
        # The chart's memory mode: the store's cap, and a limit sized to hold it.
        cap = 32 * MiB
        b = _node(cluster, "node-b", store, supervisor_url=supervisor.url, peer_store_max_bytes=cap)
        a.set_partner(b)
        cgroup.add(b.agent.proc.pid)
        _limit_above_base(cgroup, cap + 32 * MiB)
        files = {"__0_0.distcp": _payload(96 * MiB, 3)}  # over the cap, and the limit
        saved = make_checkpoint(a.root / "tier", 50, 0, files)
        a.replicate(0, 50, saved)
        state = _pushed(a, 50, 60)
        assert state["state"] == "failed" and "507" in state["error"], state
        assert "do not fit" in state["error"], state
        assert b.agent.proc.poll() is None and cgroup.oom_kills() == 0
        _heartbeats_after(supervisor, "node-b", datetime.now(UTC))
        # What fits is kept.
        small = {"__0_0.distcp": _payload(8 * MiB, 4)}
        a.replicate(0, 51, make_checkpoint(a.root / "tier", 51, 0, small))
        state = _pushed(a, 51, 60)
        assert state["state"] == "done", state
        assert os.path.getsize(store / JOB / "rank-0" / "step-0000000051" / "__0_0.distcp") == (
            8 * MiB
        )
    finally:
        cluster.teardown()

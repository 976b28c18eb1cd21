"""The peer checkpoint tier: host monitor to host monitor, for real.

Real `host-monitor` processes with a peer token: node A's worker asks A to replicate a
committed checkpoint directory (built here by hand: files plus a manifest with crc32s) to
its partner B; a spare S, whose partner is B too, restores the identical bytes from B.
The worker is the test itself (plain httpx with the worker token): these routes need no
registered process. The store's own rules (overlapping uploads, crash leftovers) are
checked in-process.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import sys
import threading
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import crc32c
import httpx
import pytest
from fastapi import FastAPI

from host_monitor.config import load_settings
from host_monitor.node import Node as HostNode
from host_monitor.peer.routes import peer_router
from host_monitor.peer.store import Mismatch, PeerStore, TooLarge
from host_monitor.peer.tier import PeerTier
from resiliency_protocol.checkpoint_manifest import Manifest
from resiliency_protocol.node_commands import CheckpointPeer
from resiliency_protocol.peer_checkpoints import ReplicateRequest
from supervisor.local.cluster import checkpoint_partner
from supervisor.local.cluster_state import JobSpec
from supervisor.local.ports import free_port
from tests.test_host_monitor import ACTUATOR, WORKER, WORKER_TOKEN, Agent, Cluster, wait_for
from tests.timing import scaled
from training.checkpoint.peer import PeerTier as WorkerPeerTier

PEER_TOKEN = "hm-test-peer-token"
PEER = {"Authorization": f"Bearer {PEER_TOKEN}"}
JOB = "j1"


def make_checkpoint(
    tier: Path,
    step: int,
    rank: int,
    files: dict[str, bytes],
    *,
    job: str | None = JOB,
    world_size: int = 8,
    created: float | None = None,
    form: int = 2,
) -> Path:
    """A committed `<tier>/step-<step>/rank-<rank>/`, as the training side writes it
    (`form` 1: as it wrote it before CRC-32C)."""
    directory = tier / f"step-{step:010d}" / f"rank-{rank}"
    directory.mkdir(parents=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    (directory / "manifest.json").write_text(
        json.dumps(
            manifest(step, rank, files, job=job, world_size=world_size, created=created, form=form)
        )
    )
    return directory


def manifest(
    step: int,
    rank: int,
    files: dict[str, bytes],
    *,
    job: str | None = JOB,
    world_size: int = 8,
    created: float | None = None,
    form: int = 2,
) -> dict[str, Any]:
    key, checksum = ("crc32c", crc32c.crc32c) if form == 2 else ("crc32", zlib.crc32)
    return {
        "format": f"resiliency-checkpoint/{form}",
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "job": job,
        "files": {n: {"size": len(d), key: checksum(d)} for n, d in files.items()},
        "created": time.time() if created is None else created,
    }


def shard(size: int, salt: int) -> bytes:
    return bytes((i * 7 + salt) % 251 for i in range(size))


class Node:
    def __init__(self, agent: Agent, root: Path, store: Path) -> None:
        self.agent = agent
        self.root = root  # checkpoint_root
        self.store = store  # peer_store_dir
        self.peer_api = httpx.Client(base_url=agent.url, headers=PEER, timeout=10)

    @property
    def url(self) -> str:
        return self.agent.url

    def set_partner(self, partner: Node | None) -> dict[str, Any]:
        if partner is None:
            r = self.agent.api.delete("/v1/checkpoint-peer")
        else:
            body = {"node": partner.agent.node, "url": partner.url}
            r = self.agent.api.put("/v1/checkpoint-peer", json=body)
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def replicate(self, rank: int, step: int, path: Path) -> dict[str, Any]:
        body = {"step": step, "path": str(path)}
        r = self.agent.worker_api.post(f"/v1/workers/{rank}/checkpoints/replicate", json=body)
        assert r.status_code == 202, r.text
        return r.json()  # type: ignore[no-any-return]

    def push_state(self, rank: int) -> dict[str, Any]:
        r = self.agent.worker_api.get(f"/v1/workers/{rank}/checkpoints/replicate")
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def wait_pushed(self, rank: int, step: int) -> dict[str, Any]:
        def finished() -> dict[str, Any] | None:
            state = self.push_state(rank)
            ok = state["step"] == step and state["state"] in ("done", "failed")
            return state if ok else None

        return wait_for(finished, 10, f"push of rank {rank} step {step}")  # type: ignore[no-any-return]

    def upload(self, rank: int, step: int, files: dict[str, bytes], job: str = JOB) -> None:
        for name, data in files.items():
            r = self.peer_api.put(
                f"/v1/peer/checkpoints/{job}/{rank}/{step}/files/{name}", content=data
            )
            assert r.status_code == 200, r.text

    def commit(self, rank: int, step: int, body: dict[str, Any], job: str = JOB) -> httpx.Response:
        return self.peer_api.post(f"/v1/peer/checkpoints/{job}/{rank}/{step}/commit", json=body)

    def newest(self, rank: int, job: str = JOB) -> httpx.Response:
        return self.peer_api.get(f"/v1/peer/checkpoints/{job}/{rank}")


class Peers:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.dead_supervisor = f"http://127.0.0.1:{free_port()}"
        # A: a training node; B: its partner; S: a spare swapped in for A (empty RAM).
        self.a = self.start("node-a", supervisor_url=self.dead_supervisor)
        self.b = self.start("node-b")
        self.s = self.start("node-s")
        self.off = self.start("node-off", peer_token=None)

    def start(self, name: str, *, peer_token: str | None = PEER_TOKEN, **flags: Any) -> Node:
        tmp = self.cluster.tmp
        root, store = tmp / name / "ram", tmp / name / "peer"
        root.mkdir(parents=True)
        env = {} if peer_token is None else {"HOST_MONITOR_PEER_TOKEN": peer_token}
        agent = self.cluster.start_agent(
            flags.pop("supervisor_url", None),
            node=name,
            env=env,
            initial_state="running",
            job=JOB,
            checkpoint_root=root,
            peer_store_dir=store,
            peer_timeout_s=5,
            **flags,
        )
        return Node(agent, root, store)


@pytest.fixture(scope="module")
def peers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Peers]:
    cluster = Cluster(tmp_path_factory.mktemp("peer"))
    try:
        p = Peers(cluster)
        p.a.set_partner(p.b)
        p.s.set_partner(p.b)
        yield p
    finally:
        cluster.teardown()


# --- end to end -----------------------------------------------------------------------------


def test_a_replicated_step_is_restored_on_a_spare_byte_for_byte(peers: Peers) -> None:
    a, b, s = peers.a, peers.b, peers.s
    files = {".metadata": shard(300, 1), "__0_0.distcp": shard(3 * 1024 * 1024 + 17, 2)}
    saved = make_checkpoint(a.root / "tier", 120, 0, files)

    queued = a.replicate(0, 120, saved)
    assert queued["step"] == 120 and queued["state"] in ("queued", "running", "done")
    state = a.wait_pushed(0, 120)
    total = sum(len(d) for d in files.values())
    assert state["state"] == "done", state
    assert state["bytes"] == total and state["replicated_step"] == 120 and state["error"] is None

    # The partner keeps it, committed with its manifest.
    r = b.newest(0)
    assert r.status_code == 200, r.text
    assert r.json()["step"] == 120
    assert r.json()["manifest"] == json.loads((saved / "manifest.json").read_text())
    kept = b.store / JOB / "rank-0" / "step-0000000120"
    assert sorted(p.name for p in kept.iterdir()) == sorted([*files, "manifest.json"])

    # The spare asks its partner (B) what it has, then restores it into its empty RAM tier.
    r = s.agent.worker_api.get("/v1/workers/0/checkpoints/peer")
    assert r.status_code == 200, r.text
    assert r.json()["step"] == 120
    dest = s.root / "tier"
    r = s.agent.worker_api.post(
        "/v1/workers/0/checkpoints/fetch-peer", json={"step": 120, "dest": str(dest)}
    )
    assert r.status_code == 200, r.text
    fetched = r.json()
    restored = dest / "step-0000000120" / "rank-0"
    assert fetched["path"] == str(restored) and fetched["bytes"] == total
    assert fetched["existed"] is False and fetched["seconds"] >= 0
    for name, data in files.items():
        assert (restored / name).read_bytes() == data
    restored_manifest = json.loads((restored / "manifest.json").read_text())
    assert restored_manifest == json.loads((saved / "manifest.json").read_text())
    assert [p.name for p in (dest / "step-0000000120").iterdir()] == ["rank-0"]  # no temp

    # Asked again: the committed directory is left alone.
    r = s.agent.worker_api.post(
        "/v1/workers/0/checkpoints/fetch-peer", json={"step": 120, "dest": str(dest)}
    )
    assert r.status_code == 200 and r.json()["existed"] is True and r.json()["bytes"] == 0

    # A step the partner does not have: 404 naming it.
    r = s.agent.worker_api.post(
        "/v1/workers/0/checkpoints/fetch-peer", json={"step": 100, "dest": str(dest)}
    )
    assert r.status_code == 404 and "step" in r.json()["detail"], r.text
    assert not (dest / "step-0000000100").exists()

    # The push was reported for goodput (kept in A's outbox: its supervisor is down).
    outbox = peers.cluster.tmp / "run" / "node-a.checkpoint-outbox.jsonl"

    def reported() -> list[dict[str, Any]]:
        if not outbox.exists():
            return []
        lines = [json.loads(line) for line in outbox.read_text().splitlines() if line]
        return [r for r in lines if r["tier"] == "peer" and r["step"] == 120]

    report = wait_for(reported, 5, "peer report in the outbox")[0]
    assert report["event"] == "saved" and report["rank"] == 0 and report["job"] == JOB
    assert report["bytes"] == total and report["total_s"] >= 0


def test_a_spares_worker_sees_and_restores_the_save_before_the_newest(peers: Peers) -> None:
    """A's rank saved steps 130 and 131 and both were copied to B; its replacement on the
    spare (the training side's peer tier, over the worker API) is told of both and
    restores the older one, as a new world does when another rank's newest is 130."""
    a, s = peers.a, peers.s
    saved = {}
    for step in (130, 131):
        files = {"__0_0.distcp": shard(1024 * 1024 + step, step)}
        path = make_checkpoint(a.root / "tier", step, 0, files, created=time.time() + step)
        saved[step] = files
        a.replicate(0, step, path)
        assert a.wait_pushed(0, step)["state"] == "done"
    tier = WorkerPeerTier(s.url, WORKER_TOKEN, 0, fetch_timeout_s=15)
    try:
        assert [step for step, _ in tier.copies()] == [131, 130]
        fetched = tier.fetch(130, s.root / "tier")
    finally:
        tier.close()
    restored = s.root / "tier" / "step-0000000130" / "rank-0"
    assert fetched == (restored, True)
    assert (restored / "__0_0.distcp").read_bytes() == saved[130]["__0_0.distcp"]
    # Through the host monitor's own download too (a worker without the data channel).
    r = s.agent.worker_api.post(
        "/v1/workers/0/checkpoints/fetch-peer", json={"step": 130, "dest": str(s.root / "http")}
    )
    assert r.status_code == 200 and r.json()["bytes"] == 1024 * 1024 + 130, r.text


def test_a_checkpoint_of_the_previous_format_is_copied_and_checked(peers: Peers) -> None:
    """Format 1 (zlib crc32 per file), as saved before an upgrade: pushed, verified by the
    partner, fetched; its manifest unchanged. A manifest that mixes the two is refused."""
    a, b, s = peers.a, peers.b, peers.s
    files = {".metadata": shard(200, 4), "__0_0.distcp": shard(70_000, 5)}
    saved = make_checkpoint(a.root / "tier", 130, 6, files, form=1)
    a.replicate(6, 130, saved)
    state = a.wait_pushed(6, 130)
    assert state["state"] == "done", state
    r = b.newest(6)
    assert r.status_code == 200 and r.json()["manifest"]["format"] == "resiliency-checkpoint/1"
    dest = s.root / "old-format"
    r = s.agent.worker_api.post(
        "/v1/workers/6/checkpoints/fetch-peer", json={"step": 130, "dest": str(dest)}
    )
    assert r.status_code == 200, r.text
    restored = dest / "step-0000000130" / "rank-6"
    assert all((restored / n).read_bytes() == d for n, d in files.items())
    assert json.loads((restored / "manifest.json").read_text()) == json.loads(
        (saved / "manifest.json").read_text()
    )
    # A flipped byte is caught by the old sum too.
    body = manifest(131, 6, files, form=1)
    b.upload(6, 131, {**files, "__0_0.distcp": b"Y" + files["__0_0.distcp"][1:]})
    r = b.commit(6, 131, body)
    assert r.status_code == 409 and "__0_0.distcp: crc32 " in r.json()["detail"], r.text
    # Format 2 summed with crc32: refused, naming the file.
    mixed = {**manifest(132, 6, files, form=1), "format": "resiliency-checkpoint/2"}
    r = b.commit(6, 132, mixed)
    assert r.status_code == 422 and "files..metadata" in r.text, r.text


def test_no_copy_at_the_partner_is_404_and_no_partner_is_503(peers: Peers) -> None:
    r = peers.s.agent.worker_api.get("/v1/workers/9/checkpoints/peer")
    assert r.status_code == 404 and "node-b" in r.json()["detail"], r.text

    spare = peers.s
    try:
        assert spare.set_partner(None)["peer"] is None
        r = spare.agent.worker_api.get("/v1/workers/0/checkpoints/peer")
        assert r.status_code == 503 and "partner" in r.json()["detail"], r.text
        # A partner that does not answer: 503 naming it.
        spare.agent.api.put(
            "/v1/checkpoint-peer",
            json={"node": "gone", "url": f"http://127.0.0.1:{free_port()}"},
        )
        r = spare.agent.worker_api.get("/v1/workers/0/checkpoints/peer", timeout=30)
        assert r.status_code == 503 and "gone" in r.json()["detail"], r.text
    finally:
        spare.set_partner(peers.b)
    status = spare.agent.api.get("/v1/checkpoint-peer").json()
    assert status["enabled"] is True and status["peer"]["node"] == "node-b"
    assert status["checkpoint_root"] == str(spare.root)


def test_a_partner_slow_to_answer_is_waited_for_and_one_gone_is_not(peers: Peers) -> None:
    """The partner's process stopped (SIGSTOP) for 6 s: its kernel still takes the
    connection, as a loaded node's does, and the lookup waits for its answer (two attempts
    of 2 s each would have given up, and the rank restored an older step). A partner that
    takes no connection is gone: 503 at once (the test above)."""
    a, b = peers.a, peers.b
    files = {".metadata": shard(100, 7), "__0_0.distcp": shard(50_000, 8)}
    saved = make_checkpoint(a.root / "tier", 140, 3, files)
    a.replicate(3, 140, saved)
    assert a.wait_pushed(3, 140)["state"] == "done"
    stopped = 6.0
    os.kill(b.agent.proc.pid, signal.SIGSTOP)
    resume = threading.Timer(stopped, os.kill, (b.agent.proc.pid, signal.SIGCONT))
    resume.start()
    try:
        began = time.monotonic()
        r = a.agent.worker_api.get("/v1/workers/3/checkpoints/peer", timeout=60)
        waited = time.monotonic() - began
    finally:
        resume.cancel()
        os.kill(b.agent.proc.pid, signal.SIGCONT)
    assert r.status_code == 200, r.text
    assert r.json()["step"] == 140 and waited >= stopped - 1, (r.json(), waited)


# --- refusals -------------------------------------------------------------------------------


def test_peer_routes_need_the_peer_token(peers: Peers) -> None:
    url = f"{peers.b.url}/v1/peer/checkpoints/{JOB}/0"
    for headers in ({}, {"Authorization": "Bearer wrong"}, WORKER, ACTUATOR):
        r = httpx.get(url, headers=headers)
        assert r.status_code == 401, (headers, r.text)
    r = httpx.put(f"{url}/5/files/x.distcp", content=b"x", headers=WORKER)
    assert r.status_code == 401
    # And the peer token opens nothing else.
    assert httpx.get(f"{peers.b.url}/v1/status", headers=PEER).status_code == 401
    r = httpx.post(
        f"{peers.b.url}/v1/workers/0/checkpoints/replicate",
        json={"step": 1, "path": "/x"},
        headers=PEER,
    )
    assert r.status_code == 401


def test_paths_outside_checkpoint_root_are_refused(peers: Peers, tmp_path: Path) -> None:
    a = peers.a
    files = {"__0_0.distcp": b"secret"}
    outside = make_checkpoint(tmp_path / "elsewhere", 3, 1, files)
    api = a.agent.worker_api

    def replicate(path: str, step: int = 3) -> httpx.Response:
        return api.post("/v1/workers/1/checkpoints/replicate", json={"step": step, "path": path})

    r = replicate(str(outside))
    assert r.status_code == 403 and r.json()["detail"].startswith("path:"), r.text
    # A symlink inside the root that leads outside, and `..`, are resolved first.
    link = a.root / "link"
    link.symlink_to(tmp_path / "elsewhere")
    r = replicate(str(link / "step-0000000003" / "rank-1"))
    assert r.status_code == 403, r.text
    r = replicate(f"{a.root}/../../{outside.relative_to(outside.parents[3])}")
    assert r.status_code == 403, r.text
    r = replicate("relative/step-0000000003/rank-1")
    assert r.status_code == 422 and "path" in r.json()["detail"], r.text
    # Inside the root, but not a committed rank directory of that step and rank.
    inside = make_checkpoint(a.root / "tier", 3, 1, files)
    r = replicate(str(inside), step=4)
    assert r.status_code == 422 and "step-0000000004/rank-1" in r.json()["detail"], r.text
    (inside / "manifest.json").unlink()
    r = replicate(str(inside))
    assert r.status_code == 422 and "manifest.json" in r.json()["detail"], r.text

    r = peers.s.agent.worker_api.post(
        "/v1/workers/1/checkpoints/fetch-peer", json={"step": 3, "dest": str(tmp_path)}
    )
    assert r.status_code == 403 and r.json()["detail"].startswith("dest:"), r.text
    assert not (tmp_path / "step-0000000003").exists()


def test_a_symlinked_file_is_not_sent(peers: Peers, tmp_path: Path) -> None:
    a, b = peers.a, peers.b
    secret = tmp_path / "secret"
    secret.write_bytes(b"not for the partner")
    files = {"__0_0.distcp": b"not for the partner"}
    saved = make_checkpoint(a.root / "tier", 8, 2, files)
    (saved / "__0_0.distcp").unlink()
    (saved / "__0_0.distcp").symlink_to(secret)
    a.replicate(2, 8, saved)
    state = a.wait_pushed(2, 8)
    assert state["state"] == "failed" and "__0_0.distcp" in state["error"], state
    assert b.newest(2).status_code == 404


def test_a_corrupted_upload_is_not_committed(peers: Peers) -> None:
    b = peers.b
    files = {".metadata": b"meta", "__0_0.distcp": shard(5000, 3)}
    body = manifest(11, 5, files)
    b.upload(5, 11, {**files, "__0_0.distcp": b"X" + files["__0_0.distcp"][1:]})
    r = b.commit(5, 11, body)
    assert r.status_code == 409, r.text
    assert r.json()["detail"].startswith("files.__0_0.distcp: crc32c"), r.text
    assert b.newest(5).status_code == 404
    # A short file: named too.
    b.upload(5, 11, {"__0_0.distcp": files["__0_0.distcp"][:-1]})
    r = b.commit(5, 11, body)
    assert r.status_code == 409 and "__0_0.distcp: size 4999" in r.json()["detail"], r.text
    # The bad file was dropped: uploading it again is enough.
    b.upload(5, 11, {"__0_0.distcp": files["__0_0.distcp"]})
    r = b.commit(5, 11, body)
    assert r.status_code == 200 and r.json()["committed"] is True, r.text
    assert b.newest(5).json()["step"] == 11


def test_bad_names_ranks_and_steps_are_refused_naming_the_field(peers: Peers) -> None:
    b = peers.b
    base = f"/v1/peer/checkpoints/{JOB}"
    for path, field in (
        (f"{base}/-1/3/files/x", "rank"),
        (f"{base}/0/x/files/x", "step"),
        (f"{base}/0/3/files/a%20b", "name"),
        (f"{base}/0/3/files/manifest.json", "name"),
        ("/v1/peer/checkpoints/-bad/0/3/files/x", "job"),
    ):
        r = b.peer_api.put(path, content=b"x")
        assert r.status_code == 422, (path, r.text)
        body = r.json()
        assert field in body.get("message", body.get("detail", "")), (path, body)
    # A manifest naming another step than the path.
    r = b.commit(0, 3, manifest(4, 0, {}))
    assert r.status_code == 422 and "manifest.step" in r.json()["detail"], r.text
    # A file name the manifest may not hold.
    r = b.commit(0, 3, manifest(3, 0, {"../x": b"x"}))
    assert r.status_code == 422, r.text


def test_the_two_newest_saves_per_rank_are_kept(peers: Peers) -> None:
    """The newest save of a rank and the one before it: ranks in lockstep can end one save
    apart, and a new world restores the newest step every rank holds."""
    b = peers.b
    now = time.time()
    for step in (5, 7, 9):
        files = {"__0_0.distcp": shard(1000, step)}
        b.upload(3, step, files)
        r = b.commit(3, step, manifest(step, 3, files, created=now + step))
        assert r.status_code == 200 and r.json()["committed"] is True, r.text
    rank_dir = b.store / JOB / "rank-3"
    assert sorted(p.name for p in rank_dir.iterdir()) == ["step-0000000007", "step-0000000009"]
    newest = b.newest(3).json()
    assert (newest["step"], [c["step"] for c in newest["older"]]) == (9, [7])
    # An older save committing after a newer one (uploads that overlapped): dropped.
    files = {"__0_0.distcp": shard(1000, 8)}
    b.upload(3, 8, files)
    r = b.commit(3, 8, manifest(8, 3, files, created=now + 8))
    assert r.status_code == 200, r.text
    assert r.json()["committed"] is False and r.json()["kept_step"] == 9
    assert sorted(p.name for p in rank_dir.iterdir()) == ["step-0000000007", "step-0000000009"]
    # A file of either copy, streamed out; not of one gone.
    for step in (7, 9):
        r = b.peer_api.get(f"/v1/peer/checkpoints/{JOB}/3/{step}/files/__0_0.distcp")
        assert r.status_code == 200 and r.content == shard(1000, step)
    assert b.peer_api.get(f"/v1/peer/checkpoints/{JOB}/3/5/files/__0_0.distcp").status_code == 404


async def test_a_new_worlds_save_and_a_full_store_keep_the_newest_alone(tmp_path: Path) -> None:
    """The save before the newest is kept only within the newest's world (a new world
    restored from a step no later than its first save), and only with room beside the next
    copy under the store's cap."""
    store = PeerStore(tmp_path / "store", max_file_bytes=1 << 20)
    store.start()

    async def save(store: PeerStore, step: int, world: int) -> None:
        data = shard(1000, step)
        await store.receive(JOB, 0, step, "a.distcp", _chunks(data))
        body = Manifest.model_validate({**manifest(step, 0, {"a.distcp": data}), "world": world})
        assert (await store.commit(JOB, 0, step, body)).committed

    def kept(store: PeerStore) -> list[int]:
        copy = store.newest(JOB, 0)
        return [] if copy is None else [c.step for c in (copy, *copy.older)]

    await save(store, 20, 1)
    await save(store, 21, 1)
    assert kept(store) == [21, 20]
    await save(store, 21, 2)  # the new world resumed from step 20
    newest = store.newest(JOB, 0)
    assert kept(store) == [21] and newest is not None and newest.manifest.world == 2
    # A cap with room for two copies (the newest, and the next as it arrives): one kept;
    # with room for three, two.
    capped = PeerStore(tmp_path / "capped", max_file_bytes=1 << 20, max_bytes=2500)
    capped.start()
    await save(capped, 1, 1)
    await save(capped, 2, 1)
    assert kept(capped) == [2]
    roomy = PeerStore(tmp_path / "roomy", max_file_bytes=1 << 20, max_bytes=6000)
    roomy.start()
    await save(roomy, 1, 1)
    await save(roomy, 2, 1)
    assert kept(roomy) == [2, 1]


def test_a_newer_request_replaces_a_queued_one(peers: Peers) -> None:
    a, b = peers.a, peers.b
    tier = a.root / "queue"
    saves = {
        step: make_checkpoint(tier, step, 4, {"__0_0.distcp": shard(2 * 1024 * 1024, step)})
        for step in (1, 2, 3)
    }
    for step, path in saves.items():
        a.replicate(4, step, path)
    state = a.wait_pushed(4, 3)
    assert state["state"] == "done" and state["replicated_step"] == 3, state
    assert b.newest(4).json()["step"] == 3


def test_the_peer_tier_off_answers_503(peers: Peers) -> None:
    off = peers.off
    r = off.peer_api.get(f"/v1/peer/checkpoints/{JOB}/0")
    assert r.status_code == 503 and "peer tier off" in r.json()["detail"], r.text
    saved = make_checkpoint(off.root / "tier", 1, 0, {"x": b"x"})
    r = off.agent.worker_api.post(
        "/v1/workers/0/checkpoints/replicate", json={"step": 1, "path": str(saved)}
    )
    assert r.status_code == 503 and "peer tier off" in r.json()["detail"], r.text
    status = off.agent.api.get("/v1/checkpoint-peer").json()
    assert status["enabled"] is False
    assert not off.store.exists()


def test_the_start_request_names_the_partner(peers: Peers) -> None:
    agent = peers.off.agent
    body = {
        "request_id": uuid.uuid4().hex,
        "job": "j2",
        "command": [sys.executable, "-c", "import time; time.sleep(60)"],
        "workers": [{"rank": 0, "local_rank": 0}],
        "checkpoint_peer": {"node": "node-b", "url": peers.b.url},
    }
    r = agent.api.post("/v1/workers/start", json=body)
    assert r.status_code == 200, r.text
    try:
        assert agent.api.get("/v1/checkpoint-peer").json()["peer"] == body["checkpoint_peer"]
    finally:
        r = agent.api.post("/v1/workers/stop", json={"grace_s": 1, "release": True})
        assert r.status_code == 200, r.text
    assert agent.api.get("/v1/checkpoint-peer").json()["peer"] is None  # a spare has none
    r = agent.api.put("/v1/checkpoint-peer", json={"node": "n", "url": "ftp://x"})
    assert r.status_code == 422 and "url" in r.json()["message"], r.text


# --- the store, in-process ------------------------------------------------------------------


async def _chunks(data: bytes, pause: float = 0.0) -> AsyncIterator[bytes]:
    for i in range(0, len(data), 1000):
        if pause:
            await asyncio.sleep(pause)
        yield data[i : i + 1000]


async def test_overlapping_uploads_of_two_steps_keep_the_newest(tmp_path: Path) -> None:
    store = PeerStore(tmp_path / "store", max_file_bytes=1 << 20)
    store.start()
    now = time.time()
    old = {"a.distcp": shard(20_000, 1)}
    new = {"a.distcp": shard(20_000, 2)}

    async def upload(step: int, files: dict[str, bytes], pause: float) -> bool:
        for name, data in files.items():
            await store.receive(JOB, 0, step, name, _chunks(data, pause))
        body = Manifest.model_validate(manifest(step, 0, files, created=now + step))
        return (await store.commit(JOB, 0, step, body)).committed

    # Step 10 starts first and is slow; step 20 commits before it.
    older, newer = await asyncio.gather(upload(10, old, 0.002), upload(20, new, 0.0))
    assert (older, newer) == (False, True)
    copy = store.newest(JOB, 0)
    assert copy is not None and copy.step == 20
    assert [p.name for p in (store.root / JOB / "rank-0").iterdir()] == ["step-0000000020"]
    assert not any((store.root / ".incoming" / JOB / "rank-0").iterdir())
    # A job that went back to an older checkpoint saves a lower step later: it wins.
    again = {"a.distcp": shard(100, 3)}
    assert await upload(15, again, 0.0) is False  # created earlier than step 20's save
    for name, data in again.items():
        await store.receive(JOB, 0, 15, name, _chunks(data))
    later = Manifest.model_validate(manifest(15, 0, again, created=now + 100))
    assert (await store.commit(JOB, 0, 15, later)).committed is True
    copy = store.newest(JOB, 0)
    assert copy is not None and copy.step == 15


async def test_a_missing_file_is_named_and_leftovers_go_at_start(tmp_path: Path) -> None:
    store = PeerStore(tmp_path / "store", max_file_bytes=1 << 20)
    store.start()
    files = {"a.distcp": b"aaaa", "b.distcp": b"bbbb"}
    await store.receive(JOB, 1, 4, "a.distcp", _chunks(files["a.distcp"]))
    body = Manifest.model_validate(manifest(4, 1, files))
    with pytest.raises(Mismatch) as err:
        await store.commit(JOB, 1, 4, body)
    assert err.value.name == "b.distcp" and "not uploaded" in str(err.value)
    await store.receive(JOB, 1, 4, "b.distcp", _chunks(files["b.distcp"]))
    assert (await store.commit(JOB, 1, 4, body)).committed
    # A crash: an upload in progress, trash, and two older copies left beside the newest.
    await store.receive(JOB, 1, 9, "a.distcp", _chunks(b"partial"))
    for step in (1, 2):
        older = store.root / JOB / "rank-1" / f"step-000000000{step}"
        older.mkdir()
        (older / "manifest.json").write_text(json.dumps(manifest(step, 1, {}, created=step)))
    (store.root / ".trash" / "x").mkdir(parents=True)
    restarted = PeerStore(store.root, max_file_bytes=1 << 20)
    restarted.start()
    assert sorted(p.name for p in store.root.iterdir()) == [JOB]
    kept = sorted(p.name for p in (store.root / JOB / "rank-1").iterdir())
    assert kept == ["step-0000000002", "step-0000000004"]  # the newest and the save before
    copy = restarted.newest(JOB, 1)
    assert copy is not None and (copy.step, [c.step for c in copy.older]) == (4, [2])
    fd, size = restarted.open_file(JOB, 1, 4, "b.distcp")
    try:
        assert size == 4 and os.read(fd, 10) == b"bbbb"
    finally:
        os.close(fd)


async def test_a_file_over_the_size_cap_is_refused(tmp_path: Path) -> None:
    store = PeerStore(tmp_path / "store", max_file_bytes=1500)
    store.start()
    with pytest.raises(TooLarge):
        await store.receive(JOB, 0, 1, "a.distcp", _chunks(b"x" * 2000))
    assert not any((store.root / ".incoming" / JOB / "rank-0" / "step-0000000001").iterdir())


class _Recording(httpx.AsyncBaseTransport):
    """The partner's app in-process; remembers each request (method and path)."""

    def __init__(self, app: Any) -> None:
        self.inner = httpx.ASGITransport(app=app)
        self.requests: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(f"{request.method} {request.url.path}")
        return await self.inner.handle_async_request(request)


async def until(predicate: Callable[[], bool], pause: float = 0.01, within: float = 5) -> None:
    deadline = time.monotonic() + scaled(within)
    for _ in itertools.count():
        if predicate():
            return
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(pause)


def _tier(tmp: Path, node: str) -> PeerTier:
    settings = load_settings(
        node=node,
        initial_state="running",
        job=JOB,
        peer_token=PEER_TOKEN,
        checkpoint_root=tmp / node / "ram",
        peer_store_dir=tmp / node / "peer",
    )
    tier = PeerTier(settings, HostNode(settings, "worker-token", f"http://{node}"))
    tier.start()
    return tier


async def test_one_push_at_a_time_per_rank_the_newest_replacing_a_queued_one(
    tmp_path: Path,
) -> None:
    a, b = _tier(tmp_path, "a"), _tier(tmp_path, "b")
    app = FastAPI()
    app.include_router(peer_router(b))
    transport = _Recording(app)
    a._http = httpx.AsyncClient(transport=transport, headers=PEER)
    a.node.checkpoint_peer = CheckpointPeer(node="b", url="http://b")
    tier_dir = a.checkpoint_root / "tier"
    saves = {s: make_checkpoint(tier_dir, s, 0, {"x.distcp": shard(1000, s)}) for s in range(1, 6)}

    def ask(step: int) -> str | None:
        return a.replicate(0, ReplicateRequest(step=step, path=str(saves[step]))).state

    def commits() -> list[str]:
        return [r for r in transport.requests if r.endswith("/commit")]

    try:
        # Asked before the push task ran: step 2 replaces step 1, which never goes.
        assert (ask(1), ask(2)) == ("queued", "queued")
        await until(lambda: a.replicate_status(0).state == "done")
        assert commits() == [f"POST /v1/peer/checkpoints/{JOB}/0/2/commit"]
        # A running push finishes; of the requests meanwhile only the newest goes next.
        ask(3)
        await until(lambda: a.replicate_status(0).state == "running", pause=0)
        ask(4)
        ask(5)
        await until(
            lambda: (
                a.replicate_status(0).model_dump(include={"step", "state"})
                == {"step": 5, "state": "done"}
            )
        )
        assert [c.split("/")[-2] for c in commits()] == ["2", "3", "5"]
        assert b.store is not None
        copy = b.store.newest(JOB, 0)
        assert copy is not None and copy.step == 5
    finally:
        await a.close()
        await b.close()


# --- the local backend's partners -------------------------------------------------------------


@pytest.mark.parametrize(
    ("replicas", "per_dp", "expected"),
    [
        (2, 2, ["n2", "n3", "n0", "n1"]),  # the same shard in the other replica
        (1, 3, ["n1", "n2", "n0"]),  # one replica: the next rank
        (3, 1, ["n1", "n2", "n0"]),
        (1, 1, [None]),
    ],
)
def test_local_partners(replicas: int, per_dp: int, expected: list[str | None]) -> None:
    job = JobSpec(
        name="j",
        command=["x"],
        num_dp_replicas=replicas,
        num_nodes_per_dp=per_dp,
        placement=[f"n{i}" for i in range(replicas * per_dp)],
    )
    assert [checkpoint_partner(job, r) for r in range(len(job.placement))] == expected

"""The peer tier's fence between worlds (host_monitor/peer/worlds.py), with real
`host-monitor` processes: a node cut off by a partition keeps pushing copies of the world
it was swapped out of; once its partner holds a copy of a newer world of the job, those
pushes are refused (409, field `world`) before any byte moves, the newer copy is kept,
and each refusal is counted in the partner's metrics.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from host_monitor.peer.wire import send_frame
from tests.test_host_monitor import Cluster
from tests.test_host_monitor_metrics import METRICS_TOKEN, scrape, value
from tests.test_host_monitor_peer import Node, Peers, make_checkpoint, manifest, shard
from tests.test_peer_data_plane import connect, incoming, reply, request

REFUSALS = "host_monitor_peer_stale_world_refusals_total"


class Nodes(Peers):
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        # OLD: cut off, still in world 1; NEW: the node that took its place in world 2;
        # PARTNER: the partner of both (the swap did not reassign it), its metrics scraped.
        self.old = self.start("node-old")
        self.new = self.start("node-new")
        self.partner = self.start("node-partner", metrics_token=METRICS_TOKEN)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    cluster = Cluster(tmp_path_factory.mktemp("worlds"))
    try:
        n = Nodes(cluster)
        n.old.set_partner(n.partner)
        n.new.set_partner(n.partner)
        yield n
    finally:
        cluster.teardown()


def saved(node: Node, step: int, world: int | None, salt: int) -> Path:
    """Rank 0's committed directory at `step`, its manifest naming `world` as the training
    side writes it (training/checkpoint/format.py)."""
    files = {".metadata": shard(300, salt), "__0_0.distcp": shard(256 * 1024 + salt, salt)}
    directory = make_checkpoint(node.root / "tier", step, 0, files)
    written = json.loads((directory / "manifest.json").read_text())
    (directory / "manifest.json").write_text(json.dumps(written | {"world": world}))
    return directory


def refusals(node: Node) -> float:
    return value(scrape(node.url), REFUSALS)


def test_a_push_of_an_older_world_is_refused_and_the_newer_copy_kept(nodes: Nodes) -> None:
    old, new, partner = nodes.old, nodes.new, nodes.partner
    assert refusals(partner) == 0
    # World 1: the old node's rank 0 at step 40.
    old.replicate(0, 40, saved(old, 40, 1, 1))
    assert old.wait_pushed(0, 40)["state"] == "done"
    # World 2 restored step 40 on the new node and saved step 60.
    new.replicate(0, 60, saved(new, 60, 2, 2))
    assert new.wait_pushed(0, 60)["state"] == "done"
    # The old node, cut off, trained on in world 1: its step 100, saved after world 2's
    # copy, is refused.
    old.replicate(0, 100, saved(old, 100, 1, 3))
    state = old.wait_pushed(0, 100)
    assert state["state"] == "failed", state
    assert "world 2 of job" in state["error"] and "409" in state["error"], state
    r = partner.newest(0)
    assert r.status_code == 200, r.text
    assert (r.json()["step"], r.json()["manifest"]["world"]) == (60, 2)
    assert incoming(partner) == []  # no byte of it kept
    assert refusals(partner) >= 1
    # What a worker of the new world's node sees of its partner's copy: world 2's.
    r = new.agent.worker_api.get("/v1/workers/0/checkpoints/peer")
    assert (r.status_code, r.json()["step"], r.json()["manifest"]["world"]) == (200, 60, 2)


def test_the_channel_refuses_an_older_world_before_its_bytes(nodes: Nodes) -> None:
    partner = nodes.partner
    before = refusals(partner)
    with connect(partner) as sock:
        send_frame(sock, request(op="put", rank=0, step=120, size=4096, world=1))
        answer = reply(sock)
    assert answer.status == 409 and (answer.detail or "").startswith("world:"), answer
    assert incoming(partner) == []
    # The same world as the newest, or a newer one, goes ahead.
    with connect(partner) as sock:
        send_frame(sock, request(op="put", rank=3, step=120, size=1, world=2))
        assert reply(sock).status == 100
    assert refusals(partner) == before + 1


def test_a_commit_of_an_older_world_or_of_none_is_refused(nodes: Nodes) -> None:
    partner = nodes.partner
    files = {"__0_0.distcp": shard(1000, 5)}
    for world in (1, None):
        # Over HTTP, which tells no world per file: the commit is where it is refused.
        partner.upload(4, 130, files)
        body = manifest(130, 4, files) | ({} if world is None else {"world": world})
        r = partner.commit(4, 130, body)
        assert r.status_code == 409, r.text
        assert r.json()["detail"].startswith("world:"), r.text
        assert partner.newest(4).status_code == 404
    body = manifest(130, 4, files) | {"world": 3}
    partner.upload(4, 130, files)
    r = partner.commit(4, 130, body)
    assert r.status_code == 200 and r.json()["committed"] is True, r.text
    # World 3 is now the job's newest here: world 2's pushes are refused in turn.
    new = nodes.new
    new.replicate(0, 80, saved(new, 80, 2, 6))
    state = new.wait_pushed(0, 80)
    assert state["state"] == "failed" and "world 3 of job" in state["error"], state

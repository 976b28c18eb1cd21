"""The peer tier's fence between worlds by the supervisor's current world: a host monitor
learns the newest world of its job from the supervisor's answers to its heartbeats
(the header `x-job-world`), and refuses a peer copy of an older world from then on,
though no rank of the newer world pushed a copy to it yet.

Real processes: `supervisor serve` with the local backend, whose cluster keeps the job's
world, and real `host-monitor`s: the partner heartbeats to the supervisor; the old node,
cut off from it, pushes copies of the world it trained in. The supervisor moves on as
it does when it starts again with a newer world kept by its backend.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from supervisor.local.cluster_state import ClusterState, JobSpec, NodeInfo
from tests.test_host_monitor import ACTUATOR_TOKEN, Cluster, Supervisor, wait_for
from tests.test_host_monitor_peer import JOB, Node, Peers
from tests.test_peer_worlds import saved
from tests.timing import scaled


def cluster_state(run_dir: Path, world: int, nodes: dict[str, str]) -> None:
    """The local backend's cluster: job JOB on `nodes` (name: URL) in `world`."""
    ClusterState(
        run_dir=str(run_dir),
        actuator_token=ACTUATOR_TOKEN,
        nodes={name: NodeInfo(address=url) for name, url in nodes.items()},
        job=JobSpec(
            name=JOB,
            command=["true"],
            num_dp_replicas=1,
            num_nodes_per_dp=len(nodes),
            placement=list(nodes),
            attempt=world,
        ),
    ).save()


class Nodes(Peers):
    def __init__(self, cluster: Cluster, supervisor_url: str) -> None:
        self.cluster = cluster
        # OLD: cut off from the supervisor, trains on in world 1; PARTNER: heard by it.
        self.old = self.start("node-old")
        self.partner = self.start("node-partner", supervisor_url=supervisor_url)


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Supervisor, Nodes, Path]]:
    run_dir = tmp_path / "local-run"
    run_dir.mkdir()
    server = Supervisor(
        tmp_path,
        env={"SUPERVISOR_BACKEND": "local", "SUPERVISOR_LOCAL_RUN_DIR": str(run_dir)},
    )
    cluster = Cluster(tmp_path)
    try:
        nodes = Nodes(cluster, server.url)
        nodes.old.set_partner(nodes.partner)
        cluster_state(run_dir, 1, {"node-old": nodes.old.url, "node-partner": nodes.partner.url})
        server.start()
        yield server, nodes, run_dir
    finally:
        cluster.teardown()
        server.stop()


def heard(server: Supervisor, node: str, after: float) -> bool:
    """Whether the supervisor took a heartbeat of `node` sent after `after` (Unix s)."""
    record: dict[str, Any] | None = server.node(node)
    if record is None or record.get("last_heartbeat") is None:
        return False
    return datetime.fromisoformat(record["last_heartbeat"]).timestamp() > after


def push(node: Node, step: int, world: int, salt: int) -> dict[str, Any]:
    node.replicate(0, step, saved(node, step, world, salt))
    return node.wait_pushed(0, step)


def test_a_copy_of_an_older_world_is_refused_once_the_supervisor_moved_on(
    setup: tuple[Supervisor, Nodes, Path],
) -> None:
    server, nodes, run_dir = setup
    old, partner = nodes.old, nodes.partner
    wait_for(lambda: heard(server, partner.agent.node, 0), 10, "the partner heard")
    # World 1: the old node's copy is kept.
    assert push(old, 40, 1, 1)["state"] == "done"
    # The supervisor moves on to world 2 (its backend keeps it; here, as it starts again
    # with it). No rank of world 2 pushes anything to the partner.
    server.stop()
    cluster_state(run_dir, 2, {"node-old": old.url, "node-partner": partner.url})
    server.http = Supervisor(server.log.parent, server.port, server.env).http
    server.start()
    moved = time.time()
    # Two heartbeats of the partner answered since: the newer world is named to it.
    wait_for(lambda: heard(server, partner.agent.node, moved), 10, "the partner heard again")
    time.sleep(scaled(0.5))
    # The old node, cut off, trained on in world 1: its step 100 is refused.
    state = push(old, 100, 1, 3)
    assert state["state"] == "failed", state
    assert "world 2 of job" in state["error"] and "409" in state["error"], state
    r = partner.newest(0)
    assert r.status_code == 200, r.text
    assert (r.json()["step"], r.json()["manifest"]["world"]) == (40, 1)

"""POST /v1/workers/world: the world of one rank's instance (a pod, by its UID), assigned
whether its worker is registered yet or not, handed only to that instance's worker.

A real host monitor (a spare, as on Kubernetes), and worker clients registering from this
test's process (the monitor adopts any live pid), over HTTP.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_host_monitor import WORKER_TOKEN, Agent, Cluster
from training.worker_client import WorkerClient

JOB = "pretrain"
WORLD = {"MASTER_PORT": "29601", "WORLD_SIZE": "2", "WORKLOAD_ATTEMPT": "1"}


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    cluster = Cluster(tmp_path)
    try:
        yield cluster.start_agent(None, node="gpu-7")
    finally:
        cluster.teardown()


def client(agent: Agent, rank: int, instance: str | None) -> WorkerClient:
    worker = WorkerClient(
        rank, 0, monitor_url=agent.url, token=WORKER_TOKEN, job=JOB, instance=instance
    )
    assert worker.register(world_size=2)
    return worker


def assign(agent: Agent, **body: Any) -> Any:
    full = {
        "request_id": f"{body['instance']}-{body.get('attempt', '1')}",
        "job": JOB,
        "attempt": "1",
        "env": WORLD,
        **body,
    }
    return agent.api.post("/v1/workers/world", json=full)


def test_a_world_reaches_the_worker_of_its_instance_registered_before_or_after(
    agent: Agent,
) -> None:
    first = client(agent, 0, "pod-a")
    try:
        r = assign(agent, rank=0, instance="pod-a")
        assert r.status_code == 200, r.text
        assert r.json() == {"request_id": "pod-a-1", "rank": 0, "attempt": "1", "delivered": True}
        assert first.new_world(5, first=True) == ("1", WORLD)
        # Assigned before its pod's worker registers (a replacement still starting).
        r = assign(agent, rank=1, instance="pod-b")
        assert r.status_code == 200 and r.json()["delivered"] is False
        second = client(agent, 1, "pod-b")
        try:
            assert second.new_world(5, first=True) == ("1", WORLD)
        finally:
            second.close()
        # A later world for the same rank replaces it, for its instance only.
        newer = {**WORLD, "MASTER_PORT": "29602", "WORKLOAD_ATTEMPT": "2"}
        r = assign(agent, rank=0, instance="pod-a", attempt="2", env=newer)
        assert r.status_code == 200 and r.json()["delivered"] is True
        assert first.new_world(5) == ("2", newer)  # new: not the attempt it trains in
    finally:
        first.close()


def test_another_instance_of_the_rank_does_not_get_it(agent: Agent) -> None:
    assert assign(agent, rank=1, instance="pod-old").status_code == 200
    other = client(agent, 1, "pod-new")  # the old pod's replacement: not its world
    try:
        assert other.new_world(0.5, first=True) is None
        assert agent.worker_api.get("/v1/workers/1/world").json() == {"attempt": None, "env": {}}
    finally:
        other.close()


def test_requests_are_idempotent_authorised_and_checked(agent: Agent) -> None:
    assert assign(agent, rank=0, instance="pod-a").status_code == 200
    again = assign(agent, rank=0, instance="pod-a")
    assert again.status_code == 200 and again.json()["delivered"] is False
    changed = assign(agent, rank=0, instance="pod-a", env={"MASTER_PORT": "1"})
    assert changed.status_code == 409 and "request_id" in changed.text
    # Workers may not assign worlds: the actuator's token only.
    body = {"request_id": "x", "job": JOB, "rank": 0, "instance": "p", "attempt": "1", "env": {}}
    assert agent.worker_api.post("/v1/workers/world", json=body).status_code in (401, 403)
    for field, value in (("rank", -1), ("attempt", "a b"), ("instance", ""), ("job", "n\n")):
        r = agent.api.post("/v1/workers/world", json={**body, field: value})
        assert r.status_code == 422 and field in r.text, (field, r.text)

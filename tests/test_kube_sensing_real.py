"""Kubernetes-side sensing (supervisor/kube/sensing.py) through the watches of the real
API server (tests/control_plane.py), as the chart's ServiceAccount: a pod stuck
terminating, a node NotReady, a JobSet down with a pod the real scheduler cannot place.

A node whose kubelet is gone is a kwok node kwok no longer plays (its label removed): a
pod deleted there stays Terminating, and its Ready condition is what the test writes.
"""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime

from supervisor.domain import Event
from tests.conftest import SettingsFactory
from tests.control_plane import ControlPlane, Identity
from tests.kube.harness import Hooks
from tests.kube_real import (
    NS,
    backend_on,
    merge_patch,
    pool_nodes,
    running,
    set_ready,
    start_jobset,
    unmanage,
    wait_running,
)
from tests.timing import scaled


def of(hooks: Hooks, kind: str, jobs: set[str | None]) -> list[Event]:
    """The events of `kind` about `jobs` (the other tests' JobSets share the namespace)."""
    return [e for e in hooks.of(kind) if e.job in jobs]


async def events(
    hooks: Hooks, kind: str, count: int, jobs: set[str | None], within: float = 60.0
) -> list[Event]:
    deadline = asyncio.get_running_loop().time() + scaled(within)
    while len(found := of(hooks, kind, jobs)) < count:
        assert asyncio.get_running_loop().time() < deadline, f"{count} {kind}: {found}"
        await asyncio.sleep(0.05)
    return found


async def test_a_pod_stuck_terminating_is_reported_once(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    """Deleted on a node whose kubelet is gone: Terminating past the threshold, reported
    once, with its grace period as the API server keeps it."""
    pool_nodes(control_plane, "st", 2)
    start_jobset(control_plane, "st", "st")
    pods = wait_running(control_plane, "st", 2, "0")
    stuck = pods[0]
    unmanage(control_plane, stuck["spec"]["nodeName"])
    hooks = Hooks()
    async with backend_on(
        control_plane, kube_supervisor, make_settings, "st", hooks, pod_termination_threshold_s=1.5
    ):
        with control_plane.client() as api:
            r = api.delete(f"/api/v1/namespaces/{NS}/pods/{stuck['metadata']['name']}")
            assert r.status_code == 200, r.text
        asked = datetime.now(UTC)
        [event] = await events(hooks, "pod_stuck_terminating", 1, {"st"})
        assert (datetime.now(UTC) - asked).total_seconds() >= 1.0  # timestamps: 1 s grain
        assert event.details["pod"] == stuck["metadata"]["name"] and event.job == "st"
        assert event.node == stuck["spec"]["nodeName"]
        assert event.details["uid"] == stuck["metadata"]["uid"]
        assert event.details["grace_period_s"] == 30
        await asyncio.sleep(3.0)
        assert len(of(hooks, "pod_stuck_terminating", {"st"})) == 1


async def test_a_node_not_ready_is_reported_once_per_episode(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    nodes = pool_nodes(control_plane, "nr", 3)
    start_jobset(control_plane, "nr", "nr")
    pods = wait_running(control_plane, "nr", 2, "0")
    node = pods[0]["spec"]["nodeName"]
    (spare,) = set(nodes) - {p["spec"]["nodeName"] for p in pods}
    hooks = Hooks()
    async with backend_on(control_plane, kube_supervisor, make_settings, "nr", hooks) as backend:
        assert await backend.discovery.wait_until(
            lambda: node in backend.discovery.nodes_of("nr"), scaled(30)
        )
        unmanage(control_plane, node)
        set_ready(control_plane, node, False)
        [event] = await events(hooks, "node_not_ready", 1, {"nr", None})
        assert event.node == node and event.job == "nr"
        assert event.details["status"] == "False"
        unmanage(control_plane, spare)
        set_ready(control_plane, spare, False)  # a spare: reported too (no job)
        found = await events(hooks, "node_not_ready", 2, {"nr", None})
        assert found[1].node == spare and found[1].job is None
        merge_patch(control_plane, f"/api/v1/nodes/{node}", {"metadata": {"labels": {"x": "y"}}})
        await asyncio.sleep(1.0)  # still NotReady: nothing new
        assert len(of(hooks, "node_not_ready", {"nr", None})) == 2
        set_ready(control_plane, node, True)
        await asyncio.sleep(1.0)
        set_ready(control_plane, node, False)  # a new episode
        await events(hooks, "node_not_ready", 3, {"nr", None})


async def test_a_jobset_down_for_want_of_a_node_is_reported_with_the_schedulers_reason(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    """Three replicas of a whole node each, two nodes: the real scheduler leaves one pod
    Pending and says why. After jobset_downtime_threshold_s one workload_down; once a
    third node comes and every pod runs, the episode ends."""
    pool_nodes(control_plane, "wd", 2)
    start_jobset(control_plane, "wd", "wd", replicas=3)
    # The JobSet as the supervisor meets it in a cluster: its pods made, two of them
    # placed (not yet made, as the real controllers take a moment, they would be down
    # for another reason).
    wait_running(control_plane, "wd", 2)
    hooks = Hooks()
    async with backend_on(
        control_plane, kube_supervisor, make_settings, "wd", hooks, jobset_downtime_threshold_s=0.5
    ) as backend:
        [event] = await events(hooks, "workload_down", 1, {"wd"})
        assert event.job == "wd" and event.node is None
        d = event.details
        assert (d["expected_pods"], d["running_pods"], d["unschedulable_pods"]) == (3, 2, 1), d
        assert re.search(r"0/\d+ nodes are available", d["scheduler_message"]), d
        await asyncio.sleep(1.0)
        assert len(of(hooks, "workload_down", {"wd"})) == 1
        pool_nodes(control_plane, "wd", 3)
        sensing = backend.sensing
        assert sensing is not None

        def ended() -> bool:
            pods = running(control_plane, "wd", 3)
            return pods is not None and sensing.jobset_health("wd") is None

        deadline = asyncio.get_running_loop().time() + scaled(60)
        while not ended():
            assert asyncio.get_running_loop().time() < deadline, sensing.jobset_health("wd")
            await asyncio.sleep(0.1)
        assert len(of(hooks, "workload_down", {"wd"})) == 1

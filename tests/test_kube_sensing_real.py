"""Kubernetes-side sensing (supervisor/kube/sensing.py) through the watches of the real
API server (tests/control_plane.py), as the chart's ServiceAccount: a pod stuck
terminating, a node NotReady, a JobSet down with a pod the real scheduler cannot place;
and the whole loop through the supervisor's HTTP API: a lost heartbeat leads the default
policy to a hot-swap carried out on the cluster, the node given back once healthy.

A node whose kubelet is gone is a kwok node kwok no longer plays (its label removed): a
pod deleted there stays Terminating, and its Ready condition is what the test writes.
"""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime

from supervisor.domain import Event
from supervisor.kube import objects as o
from tests.conftest import SettingsFactory
from tests.control_plane import ControlPlane, Identity
from tests.kube.harness import Hooks
from tests.kube_real import (
    NS,
    backend_on,
    fail_pod,
    get,
    merge_patch,
    node,
    pods_of,
    pool_nodes,
    running,
    set_ready,
    start_jobset,
    unmanage,
    wait_running,
)
from tests.kube_real_supervising import (
    OPERATOR,
    SWAP_SETTINGS,
    finished_action,
    listed,
    supervising,
    swap_scene,
    wait,
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
    once, with its grace period as the API server keeps it. The pods that terminate
    normally meanwhile (a crash elsewhere: the real JobSet controller restarts the
    JobSet, deleting them) are not reported."""
    pool_nodes(control_plane, "st", 3)
    start_jobset(control_plane, "st", "st", replicas=3)
    stuck, crashed, other = wait_running(control_plane, "st", 3, "0")
    unmanage(control_plane, stuck["spec"]["nodeName"])
    hooks = Hooks()
    threshold = 4.0  # past a normal termination's three hops on a loaded machine
    async with backend_on(
        control_plane,
        kube_supervisor,
        make_settings,
        "st",
        hooks,
        pod_termination_threshold_s=threshold,
    ):
        with control_plane.client() as api:
            r = api.delete(f"/api/v1/namespaces/{NS}/pods/{stuck['metadata']['name']}")
            assert r.status_code == 200, r.text
        asked = datetime.now(UTC)
        fail_pod(control_plane, crashed)
        [event] = await events(hooks, "pod_stuck_terminating", 1, {"st"})
        waited = (datetime.now(UTC) - asked).total_seconds()
        assert waited >= threshold - 1.0  # timestamps: 1 s grain
        assert event.details["pod"] == stuck["metadata"]["name"] and event.job == "st"
        assert event.node == stuck["spec"]["nodeName"]
        assert event.details["uid"] == stuck["metadata"]["uid"]
        assert event.details["grace_period_s"] == 30
        # The restart's deletions ended as a kubelet ends them.
        gone = {crashed["metadata"]["uid"], other["metadata"]["uid"]}
        await wait(
            lambda: not gone & {p["metadata"]["uid"] for p in pods_of(control_plane, "st")},
            "the restarted JobSet's other pods gone",
        )
        await asyncio.sleep(threshold)
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
    third node comes and every pod runs, the episode ends, and a later outage is a new
    event."""
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

        # A later outage is a new event: a node goes NotReady (its kubelet gone) and its
        # pod fails; the JobSet restarts, and one of its pods has no node again.
        victim = (running(control_plane, "wd", 3) or [])[0]
        unmanage(control_plane, victim["spec"]["nodeName"])
        set_ready(control_plane, victim["spec"]["nodeName"], False)
        fail_pod(control_plane, victim)
        await events(hooks, "workload_down", 2, {"wd"})


# --- through the supervisor's HTTP API ---------------------------------------------------------


async def test_lost_heartbeat_leads_to_a_hot_swap_on_the_cluster(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    """The real app (create_app, its lifespan, SQLite) with the Kubernetes backend: host
    monitors' heartbeats name the JobSet's nodes; a heartbeat_loss fault on one of them
    makes the default policy hot-swap it (max_workload_restarts=0). The real JobSet
    controller restarts the JobSet on the spare; once the node's host monitor is back,
    the node is given back (cordon and taint lifted); a node NotReady reaches the
    supervisor's events. The JobSet's bounds seen by the API come from its annotations."""
    name = "sn-swap"
    pods, used, spare = swap_scene(control_plane, name)
    bad = used[0]
    async with supervising(
        control_plane,
        kube_supervisor,
        make_settings,
        name,
        node_recovery_healthy_s=0.5,
        **SWAP_SETTINGS,
    ) as (supervisor, http, beats, _sent):
        for rank, each in enumerate(used):
            # Port 9 (discard) is closed here: the emergency checkpoint fails fast, and
            # the policy goes on to the hot-swap, as it does when one cannot be taken.
            beats.running(each, rank)
        beats.says[spare] = {"node": spare, "state": "spare", "address": "http://127.0.0.1:9"}
        await wait(lambda: supervisor.sensor.has_node(spare), "the spare heard")
        job = (await http.get(f"/api/v1/jobs/{name}", headers=OPERATOR)).json()
        r = await http.post(
            "/api/v1/faults", json={"kind": "heartbeat_loss", "node": bad}, headers=OPERATOR
        )
        assert r.status_code == 201, r.text
        fault_id = r.json()["id"]

        action = await finished_action(http, "hot_swap")
        assert action["status"] == "succeeded", action
        assert action["node"] == bad and action["params"]["spare"] == spare
        on_bad = next(p for p in pods if p["spec"]["nodeName"] == bad)
        assert action["result"]["pods"] == {on_bad["metadata"]["name"]: "evicted"}
        # The JobSet restarted (an evicted pod fails its Job) on the spare.
        moved = wait_running(control_plane, name, 2, "1")
        assert {p["spec"]["nodeName"] for p in moved} == {used[1], spare}

        # The node's host monitor is back: healthy for node_recovery_healthy_s, the node
        # is given back by an uncordon the backend asked for.
        r = await http.delete(f"/api/v1/faults/{fault_id}", headers=OPERATOR)
        assert r.status_code == 200, r.text
        uncordon = await finished_action(http, "uncordon")
        assert uncordon["status"] == "succeeded", uncordon
        assert uncordon["source"] == "kubernetes" and uncordon["node"] == bad

        # Kubernetes-side sensing reaches the store and the policy: a NotReady node.
        unmanage(control_plane, used[1])
        set_ready(control_plane, used[1], False)
        deadline = asyncio.get_running_loop().time() + scaled(30)
        while not (found := await listed(http, "/api/v1/events", type="node_not_ready")):
            assert asyncio.get_running_loop().time() < deadline, "no node_not_ready event"
            await asyncio.sleep(0.05)
        assert found[0]["node"] == used[1] and found[0]["job"] == name
        taint = supervisor.settings.kube_taint_key
    given_back = node(control_plane, bad)
    assert not given_back["spec"].get("unschedulable")  # swapped out, then given back
    assert not o.has_taint(given_back, taint)
    assert bad not in {p["spec"].get("nodeName") for p in pods_of(control_plane, name)}
    assert job["min_num_dp_replicas"] == 1  # from the JobSet's annotation
    ours = get(
        control_plane, f"/api/v1/namespaces/{NS}/events?fieldSelector=involvedObject.name%3D{bad}"
    )
    reasons = {
        e["reason"]: e for e in (ours or {})["items"] if e.get("reportingComponent") == o.COMPONENT
    }
    assert set(reasons) == {"HotSwap", "Uncordon"}, reasons
    assert f"supervisor action {action['id']}" in reasons["HotSwap"]["message"]

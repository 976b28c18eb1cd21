"""Kubernetes-side sensing (pods stuck terminating, JobSets down, nodes NotReady) through
the watches against the fake API server, the default policy's answers to those events,
and the whole loop through the supervisor's HTTP API: a lost heartbeat leads the default
policy to a hot-swap carried out on the fake cluster."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from policies.default import DefaultPolicy
from supervisor.api import create_app
from supervisor.domain import ActionType, Event, EventType, JobView
from supervisor.kube import objects as o
from supervisor.kube.backend import KubeBackend
from supervisor.policy import PolicyContext, PolicyLimits
from supervisor.runtime import Supervisor
from tests.conftest import AGENT_TOKEN, OPERATOR_TOKEN, SettingsFactory
from tests.kube import FakeKube
from tests.kube.harness import Hooks, kube_settings, pods_running, setup_cluster, started

AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube(time_scale=0.01, bookmark_interval=0.1, tick=0.02) as k:
        yield k


async def wait(predicate: Any, timeout: float = 10.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert asyncio.get_running_loop().time() < deadline, "condition not met"
        await asyncio.sleep(0.02)


# --- sensing -------------------------------------------------------------------------------


async def test_pod_stuck_terminating_is_reported_once(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """A pod whose termination never completes is reported once, after the threshold;
    pods that terminate normally meanwhile (the JobSet restarting) are not."""
    pods = setup_cluster(kube)
    stuck = pods[0]["metadata"]["name"]
    hooks = Hooks()
    settings = kube_settings(make_settings, pod_termination_threshold_s=1.5)
    async with started(kube, settings, hooks):
        kube.stick_pod(stuck)
        kube.delete("Pod", stuck)
        asked = datetime.now(UTC)
        [event] = await wait(lambda: hooks.of("pod_stuck_terminating"))
        assert (datetime.now(UTC) - asked).total_seconds() >= 1.0  # timestamps: 1 s grain
        assert event.details["pod"] == stuck and event.job == "train"
        assert event.node == pods[0]["spec"]["nodeName"]
        assert event.details["uid"] == pods[0]["metadata"]["uid"]
        assert event.details["grace_period_s"] == 30
        await asyncio.sleep(settings.pod_termination_threshold_s)
        assert len(hooks.of("pod_stuck_terminating")) == 1


async def test_node_not_ready_is_reported_once_per_episode(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    pods = setup_cluster(kube)
    node = pods[0]["spec"]["nodeName"]
    hooks = Hooks()
    async with started(kube, kube_settings(make_settings), hooks) as backend:
        await backend.discovery.wait_until(lambda: bool(backend.discovery.nodes_of("train")), 5)
        kube.set_node_ready(node, False)
        [event] = await wait(lambda: hooks.of("node_not_ready"))
        assert event.node == node and event.job == "train"
        assert event.details["status"] == "False"
        spare = backend.discovery.spares()[0]
        kube.set_node_ready(spare, False)  # a spare: reported too (no job)
        await wait(lambda: len(hooks.of("node_not_ready")) == 2)
        assert hooks.of("node_not_ready")[1].job is None
        kube.patch("Node", node, {"metadata": {"labels": {"x": "y"}}})  # still NotReady
        await asyncio.sleep(0.3)
        assert len(hooks.of("node_not_ready")) == 2
        kube.set_node_ready(node, True)
        await asyncio.sleep(0.2)
        kube.set_node_ready(node, False)  # a new episode
        await wait(lambda: len(hooks.of("node_not_ready")) == 3)


async def test_jobset_down_is_reported_with_pods_pending_for_lack_of_nodes(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """Three replicas, two nodes: one pod cannot be scheduled. After
    jobset_downtime_threshold_s one workload_down says so; once a node is added and every
    pod runs, the episode ends, and a later outage is a new event."""
    kube.add_node("gpu-0", gpus=8, labels={"gpu": "true"})
    kube.add_node("gpu-1", gpus=8, labels={"gpu": "true"})
    from tests.kube.harness import jobset

    kube.create(jobset(replicas=3))
    hooks = Hooks()
    settings = kube_settings(make_settings, jobset_downtime_threshold_s=0.5)
    async with started(kube, settings, hooks) as backend:
        [event] = await wait(lambda: hooks.of("workload_down"))
        assert event.job == "train" and event.node is None
        d = event.details
        assert (d["expected_pods"], d["running_pods"], d["unschedulable_pods"]) == (3, 2, 1)
        assert "0/2 nodes are available" in d["scheduler_message"]
        await asyncio.sleep(1.0)
        assert len(hooks.of("workload_down")) == 1
        kube.add_node("gpu-2", gpus=8, labels={"gpu": "true"})
        assert backend.sensing is not None
        sensing = backend.sensing
        await wait(lambda: sensing.jobset_health("train") is None)  # the episode ends
        await asyncio.sleep(0.1)
        kube.set_node_ready("gpu-2", False)
        victim = next(p for p in pods_running(kube, 3) if p["spec"]["nodeName"] == "gpu-2")
        kube.fail_pod(victim["metadata"]["name"])
        await wait(lambda: len(hooks.of("workload_down")) == 2)


# --- the default policy's answers -----------------------------------------------------------


def context(*, scaling: bool, replicas: int = 3) -> PolicyContext:
    return PolicyContext(
        now=datetime.now(UTC),
        limits=PolicyLimits(
            max_in_job_restarts=3,
            max_workload_restarts=0,
            enable_workload_scaling=scaling,
            restart_window_s=3600,
            max_restarts_in_window=10,
        ),
        jobs={"train": JobView("train", replicas, 1, 3, 1)},
    )


def test_default_policy_force_deletes_a_stuck_pod() -> None:
    event = Event(
        EventType.POD_STUCK_TERMINATING,
        datetime.now(UTC),
        node="gpu-0",
        job="train",
        details={"pod": "p-1", "namespace": "default", "uid": "u-1", "terminating_for_s": 61},
    )
    [a] = DefaultPolicy().event_policy(event, context(scaling=False))
    assert a.type is ActionType.FORCE_DELETE_POD and a.job == "train" and a.node == "gpu-0"
    assert a.params == {"pod": "p-1", "namespace": "default", "uid": "u-1"}


def test_default_policy_on_workload_down_restarts_or_scales_down() -> None:
    down = Event(EventType.WORKLOAD_DOWN, datetime.now(UTC), job="train", details={})
    starved = Event(
        EventType.WORKLOAD_DOWN, datetime.now(UTC), job="train", details={"unschedulable_pods": 2}
    )
    policy = DefaultPolicy()
    types = [a.type for a in policy.event_policy(down, context(scaling=True))]
    assert types == [ActionType.EMERGENCY_CHECKPOINT, ActionType.RESTART_WORKLOAD]
    types = [a.type for a in policy.event_policy(starved, context(scaling=False))]
    assert types == [ActionType.EMERGENCY_CHECKPOINT, ActionType.RESTART_WORKLOAD]
    actions = policy.event_policy(starved, context(scaling=True))
    assert [a.type for a in actions] == [ActionType.EMERGENCY_CHECKPOINT, ActionType.SCALE_DOWN]
    assert actions[1].params == {"to_replicas": 2}
    at_minimum = policy.event_policy(starved, context(scaling=True, replicas=1))
    assert at_minimum[-1].type is ActionType.RESTART_WORKLOAD


# --- through the supervisor's HTTP API ---------------------------------------------------------


async def test_lost_heartbeat_leads_to_a_hot_swap_on_the_cluster(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """The real app (create_app, its lifespan, SQLite) with the Kubernetes backend: host
    monitors' heartbeats name the JobSet's nodes; a heartbeat_loss fault on one of them
    makes the default policy hot-swap it (max_workload_restarts=0). The node ends
    cordoned and tainted on the fake cluster, the pod runs on the spare, and the
    JobSet's replicas and bounds seen by the API come from its annotations."""
    pods = setup_cluster(kube, nodes=3, annotations={o.MIN_REPLICAS: "1"})
    used = sorted(p["spec"]["nodeName"] for p in pods)
    spare = next(n for n in ("gpu-0", "gpu-1", "gpu-2") if n not in used)
    bad = used[0]
    settings = kube_settings(
        make_settings,
        heartbeat_timeout_s=1.5,
        node_recovery_healthy_s=0.5,
        heartbeat_polling_period_s=0.2,
        max_workload_restarts=0,
        emergency_checkpoint_timeout_s=1.0,
    )
    backend = KubeBackend(settings, kube.client(), request_timeout_s=2.0, watch_timeout_s=2)
    supervisor = Supervisor(settings, backend=backend)
    app = create_app(settings, supervisor)

    def beat(node: str, step: int) -> dict[str, Any]:
        if node == spare:
            return {"node": node, "state": "spare", "address": "http://127.0.0.1:9"}
        rank = used.index(node)
        worker = {"rank": rank, "local_rank": 0, "pid": 10 + rank, "state": "running", "step": step}
        # Port 9 (discard) is closed here: the emergency checkpoint fails fast, and the
        # policy goes on to the hot-swap, as it does when a checkpoint cannot be taken.
        return {
            "node": node,
            "state": "running",
            "job": "train",
            "workers": [worker],
            "address": "http://127.0.0.1:9",
        }

    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:

            async def beating() -> None:
                step = 0
                while True:
                    step += 1
                    for node in (*used, spare):
                        await http.post("/api/v1/heartbeats", json=beat(node, step), headers=AGENT)
                    await asyncio.sleep(0.2)

            beats = asyncio.create_task(beating())
            try:
                await wait(lambda: supervisor.sensor.has_node(spare))
                job = (await http.get("/api/v1/jobs/train", headers=OPERATOR)).json()
                r = await http.post(
                    "/api/v1/faults",
                    json={"kind": "heartbeat_loss", "node": bad},
                    headers=OPERATOR,
                )
                assert r.status_code == 201, r.text
                fault_id = r.json()["id"]

                async def hot_swap() -> dict[str, Any] | None:
                    r = await http.get(
                        "/api/v1/actions", params={"type": "hot_swap"}, headers=OPERATOR
                    )
                    items = r.json()["items"]
                    done = [a for a in items if a["status"] in ("succeeded", "failed")]
                    return done[0] if done else None

                action = None
                for _ in range(300):
                    action = await hot_swap()
                    if action:
                        break
                    await asyncio.sleep(0.05)
                assert action is not None, "no hot-swap"
                assert action["status"] == "succeeded", action
                assert action["node"] == bad and action["params"]["spare"] == spare
                on_bad = next(p for p in pods if p["spec"]["nodeName"] == bad)
                assert action["result"]["pods"] == {on_bad["metadata"]["name"]: "evicted"}

                async def listed(path: str, **params: Any) -> list[dict[str, Any]]:
                    r = await http.get(path, params=params, headers=OPERATOR)
                    assert r.status_code == 200, r.text
                    items: list[dict[str, Any]] = r.json()["items"]
                    return items

                # The JobSet restarted (an evicted pod fails its Job) on the spare.
                await wait(
                    lambda: (
                        {p["spec"]["nodeName"] for p in pods_running(kube, 2)} == {used[1], spare}
                    )
                )

                # The node's host monitor is back: healthy for node_recovery_healthy_s,
                # the node is given back by an uncordon the backend asked for.
                r = await http.delete(f"/api/v1/faults/{fault_id}", headers=OPERATOR)
                assert r.status_code == 200, r.text
                uncordon: list[dict[str, Any]] = []
                for _ in range(300):
                    uncordon = await listed("/api/v1/actions", type="uncordon", status="succeeded")
                    if uncordon:
                        break
                    await asyncio.sleep(0.05)
                assert uncordon and uncordon[0]["source"] == "kubernetes"
                assert uncordon[0]["node"] == bad

                # Kubernetes-side sensing reaches the store and the policy: a NotReady node.
                kube.set_node_ready(used[1], False)
                events: list[dict[str, Any]] = []
                for _ in range(300):
                    events = await listed("/api/v1/events", type="node_not_ready")
                    if events:
                        break
                    await asyncio.sleep(0.05)
                assert events and events[0]["node"] == used[1] and events[0]["job"] == "train"
            finally:
                beats.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beats
    node = kube.get("Node", bad)
    assert not node["spec"].get("unschedulable")  # swapped out, then given back
    assert not any(t["key"] == settings.kube_taint_key for t in node["spec"].get("taints") or [])
    moved = kube.objects("Pod", label_selector=f"{o.JOBSET_NAME}=train")
    assert bad not in {p["spec"].get("nodeName") for p in moved}
    assert job["min_num_dp_replicas"] == 1  # from the JobSet's annotation
    reasons = {e["reason"]: e for e in kube.objects("Event") if e["involvedObject"]["name"] == bad}
    assert set(reasons) == {"HotSwap", "Uncordon"}
    assert f"supervisor action {action['id']}" in reasons["HotSwap"]["message"]

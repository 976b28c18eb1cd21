"""The Kubernetes backend's actions and discovery, through the official client over HTTP
against the fake API server (tests/kube): each action, its idempotent repeat, and the
API's error paths."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from supervisor.actuator.backend import ActionError
from supervisor.domain import ActionType
from supervisor.kube import objects as o
from tests.conftest import SettingsFactory
from tests.kube import FakeKube
from tests.kube.harness import (
    JS,
    NS,
    Hooks,
    action,
    kube_settings,
    mutations,
    pods_running,
    running_pods,
    setup_cluster,
    started,
)


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube(time_scale=0.01, bookmark_interval=0.1, tick=0.02) as k:
        yield k


def events_about(kube: FakeKube, name: str, reason: str | None = None) -> list[dict[str, Any]]:
    return [
        e
        for e in kube.objects("Event")
        if e["involvedObject"]["name"] == name and (reason is None or e["reason"] == reason)
    ]


async def until(backend: Any, predicate: Any, timeout: float = 10.0) -> None:
    assert await backend.discovery.wait_until(predicate, timeout), "condition not met"


# --- discovery ----------------------------------------------------------------------------


async def test_watch_relists_after_410_and_reconnects_after_errors(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """A watch resumed from a compacted resourceVersion gets 410 Gone: the informer lists
    again and reports what changed meanwhile (a pod deleted, one added) as DELETED/ADDED."""
    setup_cluster(kube)
    async with started(kube, kube_settings(make_settings)) as backend:
        informer = backend.discovery.informers["Pod"]
        await until(backend, lambda: len(informer.items) == 2)
        seen: list[tuple[str, str]] = []
        informer.listeners.append(lambda t, obj, _b: seen.append((t, o.name_of(obj))))
        # Cut the pods' watch: every reconnect fails (500) until the fault is lifted.
        cut = kube.fail_next("watch", r"/pods$", status=500, times=10_000)
        kube.wait_for(lambda: cut.hits >= 1, 10)
        victim = sorted(informer.items.values(), key=o.name_of)[0]
        kube.delete("Pod", o.name_of(victim), grace_period_seconds=0)
        kube.wait_for(lambda: kube.get("Pod", o.name_of(victim)) is None, 10)
        kube.create(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "late", "labels": {o.JOBSET_NAME: "train"}},
                "spec": {"containers": [{"name": "c", "image": "i"}]},
            }
        )
        kube.compact()
        cut.times = cut.hits  # the API server is back
        await until(
            backend, lambda: informer.stats["gone"] >= 1 and "default/late" in informer.items
        )
        assert ("DELETED", o.name_of(victim)) in seen and ("ADDED", "late") in seen
        assert informer.stats["errors"] >= 1 and informer.stats["lists"] >= 2
        # Watching resumed after the re-list: later changes arrive again.
        kube.patch("Pod", "late", {"metadata": {"labels": {"x": "y"}}})
        await until(
            backend, lambda: informer.items["default/late"]["metadata"]["labels"].get("x") == "y"
        )


async def test_bookmarks_keep_a_quiet_watch_resumable(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """Nothing changes in the pods while the rest of the cluster moves on: BOOKMARK events
    advance the watch's resourceVersion, so after a compaction the reconnect (the stream
    ends every watch_timeout_s) resumes without a 410 and without listing again."""
    setup_cluster(kube)
    async with started(kube, kube_settings(make_settings)) as backend:
        informer = backend.discovery.informers["Pod"]
        await until(backend, lambda: len(informer.items) == 2)
        kube.add_node("other", labels={"gpu": "false"})  # moves the global resourceVersion
        latest = str(kube.resource_version)
        kube.wait_for(lambda: informer.resource_version == latest, 10)
        kube.compact()
        watches = informer.stats["watches"]
        kube.wait_for(lambda: informer.stats["watches"] > watches, 10)
        assert informer.stats["gone"] == 0 and informer.stats["lists"] == 1


# --- restart in place ---------------------------------------------------------------------


async def test_restart_in_place_evicts_the_pod_once(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """Eviction (policy/v1) of the pod on the node: DisruptionTarget, the JobSet restarts
    it (the failure policy of docs/kubernetes.md: not counted against maxRestarts); the
    same key again sends no write at all; an Event on the pod and the JobSet says what and
    why."""
    pods = setup_cluster(kube)
    node = pods[0]["spec"]["nodeName"]
    async with started(kube, kube_settings(make_settings)) as backend:
        await until(backend, lambda: node in backend.discovery.nodes_of("train"))
        a = action(ActionType.RESTART_IN_PLACE, node=node, reason="worker exited")
        result = await backend.execute(a)
        assert result == {"pods": {pods[0]["metadata"]["name"]: "evicted"}}
        evictions = [r for r in kube.requests if r.path.endswith("/eviction")]
        assert len(evictions) == 1 and evictions[0].status == 201
        # The JobSet restarts (all pods of attempt 1 run) without using maxRestarts.
        kube.wait_for(
            lambda: [
                p
                for p in pods_running(kube, 2)
                if p["metadata"]["labels"][o.RESTART_ATTEMPT] == "1"
            ],
            10,
        )
        status = kube.get("JobSet", "train")["status"]
        assert status["restarts"] == 1 and status.get("restartsCountTowardsMax", 0) == 0
        reasons = {e["reason"] for e in events_about(kube, "train")}
        assert "RestartInPlace" in reasons
        message = events_about(kube, pods[0]["metadata"]["name"], "RestartInPlace")[0]["message"]
        assert "supervisor action 1: worker exited" in message

        before = len(kube.requests)
        again = await backend.execute(a)
        assert again["repeated"] is True and mutations(kube, before) == []


# --- workload restart ---------------------------------------------------------------------


async def test_restart_workload_evicts_and_the_jobset_controller_restarts_it(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """With the failure policy of "JobSet requirements": every pod of the current Jobs
    evicted (UID preconditions), so the Jobs fail (PodFailurePolicy) and the JobSet
    controller restarts the JobSet without counting it: `restart-attempt` goes up to 1
    on the new Jobs and pods, `restartsCountTowardsMax` stays 0."""
    pods = setup_cluster(kube)
    old_pods = {p["metadata"]["uid"] for p in pods}
    async with started(kube, kube_settings(make_settings)) as backend:
        await until(backend, lambda: len(backend.discovery.child_jobs("train")) == 2)
        old_jobs = {j["metadata"]["uid"] for j in kube.objects("Job")}
        before = len(kube.requests)
        result = await backend.execute(action(ActionType.RESTART_WORKLOAD, reason="hang"))
        assert result["method"] == "evict" and result["restart_attempt"] == 1, result
        assert result["pods"] == {p["metadata"]["name"]: "evicted" for p in pods}
        writes = mutations(kube, before)
        evictions = sorted(path.split("/")[-2] for m, path in writes if path.endswith("/eviction"))
        assert evictions == sorted(result["pods"]) and not [w for w in writes if w[0] == "DELETE"]
        # When execute returns, the JobSet has restarted: new Jobs of attempt 1.
        jobs = kube.objects("Job")
        assert len(jobs) == 2 and not {j["metadata"]["uid"] for j in jobs} & old_jobs
        assert {j["metadata"]["labels"][JS + "restart-attempt"] for j in jobs} == {"1"}
        running = kube.wait_for(lambda: pods_running(kube, 2), 10)
        assert not {p["metadata"]["uid"] for p in running} & old_pods
        assert {p["metadata"]["labels"][JS + "restart-attempt"] for p in running} == {"1"}
        status = kube.get("JobSet", "train")["status"]
        assert status["restarts"] == 1 and status.get("restartsCountTowardsMax", 0) == 0
        (event,) = events_about(kube, "train", "RestartWorkload")
        assert "restart-attempt 1" in event["message"], event

        before = len(kube.requests)
        again = await backend.execute(action(ActionType.RESTART_WORKLOAD, reason="hang"))
        assert again["repeated"] is True and mutations(kube, before) == []


async def test_restart_workload_without_the_policy_recreates_the_child_jobs(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """A JobSet whose failed Jobs would use up maxRestarts (no rule for PodFailurePolicy):
    its child Jobs are deleted with propagationPolicy Foreground (a Job deleted without
    it orphans its pods) and UID preconditions, and the JobSet controller recreates them;
    its restart counters are untouched, and the event says restart-attempt stays."""
    pods = setup_cluster(kube, failure_policy={"maxRestarts": 3})
    old_pods = {p["metadata"]["uid"] for p in pods}
    async with started(kube, kube_settings(make_settings)) as backend:
        await until(backend, lambda: len(backend.discovery.child_jobs("train")) == 2)
        old_jobs = {j["metadata"]["uid"] for j in kube.objects("Job")}
        before = len(kube.requests)
        result = await backend.execute(action(ActionType.RESTART_WORKLOAD, reason="hang"))
        assert result["method"] == "delete_jobs" and result["restart_attempt"] == 0, result
        assert result["deleted_jobs"] == ["train-workers-0", "train-workers-1"]
        deletes = [r for r in kube.requests[before:] if r.method == "DELETE"]
        assert [d.path.rsplit("/", 1)[-1] for d in deletes] == result["deleted_jobs"]
        new_jobs = {j["metadata"]["uid"] for j in kube.objects("Job")}
        assert len(new_jobs) == 2 and not new_jobs & old_jobs
        running = kube.wait_for(lambda: pods_running(kube, 2), 10)
        assert not {p["metadata"]["uid"] for p in running} & old_pods
        assert kube.get("JobSet", "train")["status"].get("restarts", 0) == 0
        (event,) = events_about(kube, "train", "RestartWorkload")
        assert "restart-attempt stays 0" in event["message"]
        assert "gets RestartJobSet, not RestartJobSetAndIgnoreMaxRestarts" in event["message"]


# --- hot-swap and the node's way back -------------------------------------------------------


async def test_hot_swap_moves_the_pod_to_a_spare_and_recovery_gives_the_node_back(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """Cordon + our NoExecute taint (other taints kept: spec.taints is written whole) +
    health label; the pod is evicted and rescheduled on a spare; once the node is Ready
    and heartbeating for node_recovery_healthy_s an uncordon is requested, which
    removes the taint and sets the label back to Schedulable."""
    hooks = Hooks()
    settings = kube_settings(make_settings, node_recovery_healthy_s=0.3)
    pods = setup_cluster(kube)
    node = pods[0]["spec"]["nodeName"]
    kube.patch(
        "Node", node, {"spec": {"taints": [{"key": "other", "value": "x", "effect": "NoSchedule"}]}}
    )
    async with started(kube, settings, hooks) as backend:
        await until(backend, lambda: node in backend.discovery.nodes_of("train"))
        spares = backend.discovery.spares()
        hooks.heartbeating[node] = False  # its host monitor is silent: no recovery yet
        result = await backend.execute(
            action(ActionType.HOT_SWAP, node=node, spare=spares[0], reason="xid 79")
        )
        assert result["pods"] == {pods[0]["metadata"]["name"]: "evicted"}
        n = kube.get("Node", node)
        assert n["spec"]["unschedulable"] is True
        assert {t["key"] for t in n["spec"]["taints"]} == {"other", settings.kube_taint_key}
        assert n["metadata"]["labels"][settings.kube_node_health_label] == o.PENDING_REPLACEMENT
        moved = kube.wait_for(lambda: pods_running(kube, 2), 10)
        assert node not in {p["spec"]["nodeName"] for p in moved}
        assert events_about(kube, node, "HotSwap") and events_about(kube, "train", "HotSwap")

        before = len(kube.requests)
        again = await backend.execute(action(ActionType.HOT_SWAP, node=node, spare=spares[0]))
        assert again["repeated"] is True and mutations(kube, before) == []

        assert backend.recovery is not None
        await backend.recovery.check()
        assert hooks.requests == []  # Ready, but not heartbeating
        hooks.heartbeating[node] = True
        await backend.recovery.check()
        assert hooks.requests == []  # healthy from now on; node_recovery_healthy_s to go
        for _ in range(100):  # the recovery loop itself runs every period_s
            if hooks.requests:
                break
            await asyncio.sleep(0.05)
        [(request, key)] = hooks.requests
        assert request.type is ActionType.UNCORDON and request.node == node
        result = await backend.execute(
            action(ActionType.UNCORDON, node=node, job=None, key=key, id_=2)
        )
        n = kube.get("Node", node)
        assert not n["spec"].get("unschedulable")
        assert [t["key"] for t in n["spec"]["taints"]] == ["other"]
        assert n["metadata"]["labels"][settings.kube_node_health_label] == o.SCHEDULABLE
        assert events_about(kube, node, "Uncordon")
        # Schedulable again: capacity is back, said once.
        for _ in range(200):  # the recovery loop runs every period_s
            if hooks.of("node_recovered"):
                break
            await asyncio.sleep(0.05)
        await backend.recovery.check()
        [recovered] = hooks.of("node_recovered")
        assert recovered.node == node and recovered.details["uncordoned_by"] == key
        # Nodes and JobSets are only ever patched (RBAC: no update verb needed).
        assert not [r for r in kube.requests if r.method == "PUT"]


async def test_cordon_and_uncordon(kube: FakeKube, make_settings: SettingsFactory) -> None:
    kube.add_node("gpu-0", gpus=8, labels={"gpu": "true"})
    settings = kube_settings(make_settings)
    async with started(kube, settings) as backend:
        await backend.execute(action(ActionType.CORDON, node="gpu-0", job=None))
        n = kube.get("Node", "gpu-0")
        assert n["spec"]["unschedulable"] is True
        assert n["metadata"]["labels"][settings.kube_node_health_label] == o.UNSCHEDULABLE
        await backend.execute(action(ActionType.UNCORDON, node="gpu-0", job=None, key="k2"))
        n = kube.get("Node", "gpu-0")
        assert not n["spec"].get("unschedulable")
        assert n["metadata"]["labels"][settings.kube_node_health_label] == o.SCHEDULABLE
        assert len(events_about(kube, "gpu-0")) == 2
        with pytest.raises(ActionError, match="not found"):
            await backend.execute(action(ActionType.CORDON, node="nope", job=None, key="k3"))


# --- scale down / up --------------------------------------------------------------------------


async def test_scale_down_then_up_recreates_the_jobset_and_restores_it_exactly(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """replicas is immutable (the JobSet webhook answers 403), so the JobSet is deleted
    (Foreground), its pods are watched until gone, and it is created again from its own
    spec with fewer replicas, NUM_DP_REPLICAS/NNODES set and the original spec kept in an
    annotation; scaling back up restores that spec exactly. Bounds come from annotations."""
    pods = setup_cluster(kube, annotations={o.MIN_REPLICAS: "1"}, env={"NNODES": "2", "X": "1"})
    bad = pods[0]["spec"]["nodeName"]
    original = kube.get("JobSet", "train")
    settings = kube_settings(make_settings)
    async with started(kube, settings) as backend:
        await until(backend, lambda: len(backend.discovery.nodes_of("train")) == 2)
        with pytest.raises(ActionError, match=r"outside \[1, 2\]"):
            await backend.execute(action(ActionType.SCALE_DOWN, key="k0", to_replicas=0))
        a = action(ActionType.SCALE_DOWN, to_replicas=1, exclude_node=bad, reason="no spare")
        result = await backend.execute(a)
        assert result == {"num_dp_replicas": 1, "from_replicas": 2}
        js = kube.get("JobSet", "train")
        assert js["metadata"]["uid"] != original["metadata"]["uid"]
        assert js["spec"]["replicatedJobs"][0]["replicas"] == 1
        container = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
            "containers"
        ][0]
        assert {e["name"]: e["value"] for e in container["env"]} == {
            "X": "1",
            "NUM_DP_REPLICAS": "1",
            "NNODES": "1",
        }
        annotations = js["metadata"]["annotations"]
        assert annotations[o.NUM_DP_REPLICAS] == "1" and o.RECREATE not in annotations
        assert json.loads(annotations[o.ORIGINAL_SPEC]) == original["spec"]
        assert js["metadata"]["labels"] == {"team": "ml"}
        assert kube.get("Node", bad)["spec"]["unschedulable"] is True
        running = kube.wait_for(lambda: pods_running(kube, 1), 10)
        assert running[0]["spec"]["nodeName"] != bad
        await until(
            backend,
            lambda: (
                backend.job_views().get("train") is not None
                and backend.job_views()["train"].num_dp_replicas == 1
            ),
        )
        assert events_about(kube, "train", "ScaleDown")

        before = len(kube.requests)
        assert (await backend.execute(a))["repeated"] is True
        assert mutations(kube, before) == []

        up = action(ActionType.SCALE_UP, key="k2", to_replicas=2, reason="spare back")
        assert await backend.execute(up) == {"num_dp_replicas": 2, "from_replicas": 1}
        restored = kube.get("JobSet", "train")
        assert restored["spec"] == original["spec"]
        assert o.ORIGINAL_SPEC not in restored["metadata"]["annotations"]
        assert restored["metadata"]["annotations"][o.MIN_REPLICAS] == "1"
        kube.wait_for(lambda: pods_running(kube, 2), 10)


# --- force delete -------------------------------------------------------------------------------


async def test_force_delete_removes_a_stuck_pod(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    pods = setup_cluster(kube)
    name, uid = pods[0]["metadata"]["name"], pods[0]["metadata"]["uid"]
    kube.stick_pod(name)
    kube.delete("Pod", name)
    async with started(kube, kube_settings(make_settings)) as backend:
        await until(
            backend, lambda: o.terminating(backend.discovery.informers["Pod"].items[f"{NS}/{name}"])
        )
        a = action(ActionType.FORCE_DELETE_POD, pod=name, namespace=NS, uid=uid)
        assert await backend.execute(a) == {"pod": name, "outcome": "deleted"}
        kube.wait_for(lambda: kube.get("Pod", name) is None, 5)
        await until(backend, lambda: f"{NS}/{name}" not in backend.discovery.informers["Pod"].items)
        assert await backend.execute(a) == {"pod": name, "outcome": "gone"}


# --- API errors ---------------------------------------------------------------------------


async def test_transient_errors_are_retried_and_conflicts_reread(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """503 on the node's read (urllib3 retries it), 429 on the write (retried after its
    Retry-After: 1), 500 (retried), then a 409 (a stale resourceVersion): read again,
    write again; then the journal marks it done."""
    kube.add_node("gpu-0", gpus=8, labels={"gpu": "true"})
    async with started(kube, kube_settings(make_settings)) as backend:
        kube.fail_next("get", r"/nodes/gpu-0$", status=503)
        kube.fail_next("patch", r"/nodes/gpu-0$", status=429)
        kube.fail_next("patch", r"/nodes/gpu-0$", status=500)
        kube.fail_next("patch", r"/nodes/gpu-0$", status=409)
        started_at = time.monotonic()
        await backend.execute(action(ActionType.CORDON, node="gpu-0", job=None))
        assert time.monotonic() - started_at >= 1.0  # Retry-After honoured
        node = kube.get("Node", "gpu-0")
        assert node["spec"]["unschedulable"] is True
        puts = [r for r in kube.requests if r.method == "PATCH" and r.path.endswith("/gpu-0")]
        assert [p.status for p in puts] == [429, 500, 409, 200, 200]


async def test_persistent_errors_end_as_action_errors_with_the_reason(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """What outlives the retries fails the action (retryable, so the actuator tries again
    later) with the request and the server's reason; nothing raises past the backend."""
    setup_cluster(kube)
    async with started(kube, kube_settings(make_settings), request_timeout_s=0.5) as backend:
        await until(backend, lambda: backend.discovery.node("gpu-0") is not None)
        fault = kube.fail_next("patch", r"/nodes/gpu-0$", status=503, times=10)
        with pytest.raises(ActionError, match="patch node gpu-0: HTTP 503") as e:
            await backend.execute(action(ActionType.CORDON, node="gpu-0", job=None))
        assert e.value.retryable and fault.hits == backend.calls.attempts
        fault.times = fault.hits
        # A slow server: the request timeout ends each wait, not the actuator's timeout.
        # (urllib3 itself retries GET/PUT/DELETE read timeouts; an eviction is a POST.)
        node = running_pods(kube)[0]["spec"]["nodeName"]
        await until(backend, lambda: node in backend.discovery.nodes_of("train"))
        slow = kube.fail_next("create", r"/eviction$", status=None, delay=1, times=100)
        with pytest.raises(ActionError, match=r"evict pod .*ReadTimeoutError") as e:
            await backend.execute(action(ActionType.RESTART_IN_PLACE, node=node, key="k2"))
        assert e.value.retryable and slow.hits == backend.calls.attempts
        slow.times = slow.hits
        with pytest.raises(ActionError, match="needs a node"):
            await backend.execute(action(ActionType.CORDON, node=None, job=None, key="k3"))
        with pytest.raises(ActionError, match=r'jobsets.* "nope" not found'):
            await backend.execute(action(ActionType.RESTART_WORKLOAD, job="nope", key="k4"))


async def test_eviction_blocked_by_a_pdb_falls_back_to_delete(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """A PodDisruptionBudget that allows no disruption: 429 TooManyRequests, retried with
    backoff for eviction_patience_s (1 s here), then the pod is deleted with
    pod_deletion_grace_period_s instead."""
    pods = setup_cluster(kube)
    kube.create(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "all"},
            "spec": {"minAvailable": 2, "selector": {"matchLabels": {o.JOBSET_NAME: "train"}}},
        }
    )
    node = pods[0]["spec"]["nodeName"]
    settings = kube_settings(make_settings, pod_deletion_grace_period_s=7)
    async with started(kube, settings) as backend:
        await until(backend, lambda: node in backend.discovery.nodes_of("train"))
        result = await backend.execute(action(ActionType.RESTART_IN_PLACE, node=node))
        assert result == {"pods": {pods[0]["metadata"]["name"]: "deleted"}}
        evictions = [r.status for r in kube.requests if r.path.endswith("/eviction")]
        assert len(evictions) >= 3 and set(evictions) == {429}
        deletes = [r for r in kube.requests if r.method == "DELETE" and "/pods/" in r.path]
        assert len(deletes) == 1
        pod = kube.get("Pod", pods[0]["metadata"]["name"])
        assert pod is None or pod["metadata"]["deletionGracePeriodSeconds"] == 7

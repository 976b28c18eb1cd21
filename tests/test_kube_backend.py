"""The Kubernetes backend's actions and discovery, through the official client over HTTP
against the fake API server (tests/kube): each action, its idempotent repeat, and the
API's error paths."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.actuator.backend import ActionError, Fenced
from supervisor.domain import ActionType
from supervisor.kube import objects as o
from supervisor.kube.backend import KubeBackend
from supervisor.local.cluster_state import free_port
from supervisor.runtime import make_backend
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
from tests.test_host_monitor import ACTUATOR_TOKEN, Cluster


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


async def test_discovery_maps_pods_nodes_spares_and_bounds(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """Pods of the JobSet by node, spares (schedulable GPU nodes with no JobSet pod), and
    replicas with bounds from the JobSet's annotations, falling back to the settings."""
    pods = setup_cluster(kube, annotations={o.MIN_REPLICAS: "1", o.MAX_REPLICAS: "3"}, replicas=2)
    kube.add_node("cpu-0", labels={"gpu": "false"})  # not a GPU node: never a spare
    kube.add_node("gpu-9", gpus=8, labels={"gpu": "true"}, unschedulable=True)
    async with started(kube, kube_settings(make_settings)) as backend:
        used = sorted(p["spec"]["nodeName"] for p in pods)
        await until(backend, lambda: backend.discovery.nodes_of("train") == used)
        assert backend.discovery.spares() == sorted(
            {"gpu-0", "gpu-1", "gpu-2", "gpu-3"} - set(used)
        )
        view = backend.job_views()["train"]
        assert (view.num_dp_replicas, view.min_num_dp_replicas, view.max_num_dp_replicas) == (
            2,
            1,
            3,
        )
        assert view.num_nodes_per_dp == 1 and list(view.nodes) == used
        assert backend.discovery.jobset_on(used[0]) == "train"

        # A change reaches the cache by the watch: annotations removed -> settings' bounds.
        kube.patch("JobSet", "train", {"metadata": {"annotations": {o.MIN_REPLICAS: None}}})
        await until(backend, lambda: backend.job_views()["train"].min_num_dp_replicas == 1)
    # close() ended every watch thread.
    assert not [i for i in backend.discovery.informers.values() if i._thread.is_alive()]


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


async def test_restart_workload_resumed_after_a_crash_restarts_nothing_new(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """A crash after the pods were evicted: the repeat finds its journal entry (the old
    Jobs' UIDs) and the restart done, so the new Jobs and pods are left alone."""
    setup_cluster(kube)
    async with started(kube, kube_settings(make_settings)) as backend:
        await until(backend, lambda: len(backend.discovery.child_jobs("train")) == 2)
        a = action(ActionType.RESTART_WORKLOAD, key="crashy")
        await backend.execute(a)
        running = kube.wait_for(lambda: pods_running(kube, 2), 10)
        # Forget that it finished, as if the supervisor died before recording it.
        js = kube.get("JobSet", "train")
        journal = json.loads(js["metadata"]["annotations"][o.JOURNAL])
        journal["crashy"]["done"] = False
        kube.patch(
            "JobSet", "train", {"metadata": {"annotations": {o.JOURNAL: json.dumps(journal)}}}
        )
        jobs = {j["metadata"]["uid"] for j in kube.objects("Job")}
        before = len(kube.requests)
        result = await backend.execute(a)
        assert result == {"method": "evict", "pods": {}, "restart_attempt": 1}, result
        assert {j["metadata"]["uid"] for j in kube.objects("Job")} == jobs
        assert {p["metadata"]["uid"] for p in running_pods(kube)} == {
            p["metadata"]["uid"] for p in running
        }
        writes = [w for w in mutations(kube, before) if "/events" not in w[1]]
        assert [path.rsplit("/", 1)[-1] for _, path in writes] == ["train"], writes


async def test_a_fenced_replica_sends_nothing(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """Once the fence says this replica may no longer act (its leadership lapsed), an
    action raises Fenced before sending any request: not even its journal entry."""
    setup_cluster(kube)
    hooks = Hooks()
    async with started(kube, kube_settings(make_settings), hooks) as backend:
        await until(backend, lambda: len(backend.discovery.child_jobs("train")) == 2)
        hooks.fenced = "the Lease may be someone else's"
        before = len(kube.requests)
        with pytest.raises(Fenced, match="someone else's"):
            await backend.execute(action(ActionType.RESTART_WORKLOAD))
        with pytest.raises(Fenced):
            await backend.execute(action(ActionType.CORDON, node="gpu-0", job=None, key="k2"))
        assert mutations(kube, before) == []
        assert "resiliency.supervisor.io/actions" not in kube.get("JobSet", "train")[
            "metadata"
        ].get("annotations", {})


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


async def test_scale_resumed_after_a_crash_between_delete_and_create(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """The old JobSet is gone and the supervisor that deleted it died before creating the
    new one: a new supervisor finds the new body on the Event recorded before the delete."""
    setup_cluster(kube, annotations={o.MIN_REPLICAS: "1"})
    settings = kube_settings(make_settings)
    a = action(ActionType.SCALE_DOWN, to_replicas=1, reason="no spare")
    down = kube.fail_next("create", r"/jobsets$", status=503, times=1000)
    async with started(kube, settings) as backend:
        await until(backend, lambda: len(backend.discovery.nodes_of("train")) == 2)
        with pytest.raises(ActionError, match="create jobset train: HTTP 503") as e:
            await backend.execute(a)
        assert e.value.retryable
    assert kube.get("JobSet", "train") is None
    down.times = down.hits
    async with started(kube, settings) as fresh:
        assert await fresh.execute(a) == {"num_dp_replicas": 1, "from_replicas": 2}
    assert kube.get("JobSet", "train")["spec"]["replicatedJobs"][0]["replicas"] == 1
    kube.wait_for(lambda: pods_running(kube, 1), 10)
    assert len(events_about(kube, "train", "Rescaling")) == 1


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


# --- emergency checkpoint through real host monitors ------------------------------------------


async def test_emergency_checkpoint_goes_through_the_host_monitors(
    kube: FakeKube, make_settings: SettingsFactory, tmp_path: Path
) -> None:
    """Two real host monitor processes, one per node of the JobSet, with real workers:
    the node found by the heartbeat's address, the other by its InternalIP and
    host_monitor_port; the actuator token is presented; every rank acks. A rank that
    never acks makes the action fail and say which."""
    pods = setup_cluster(kube)
    nodes = sorted(p["spec"]["nodeName"] for p in pods)
    cluster = Cluster(tmp_path)
    try:
        by_heartbeat = cluster.start_agent(None, node=nodes[0])
        port = free_port()
        by_ip = cluster.start_agent(None, node=nodes[1], port=port, host="127.0.0.1")
        cluster.start_workers(by_heartbeat, [0])
        cluster.start_workers(by_ip, [1], env={"NO_ACK_RANKS": ""})
        cluster.wait_running(by_heartbeat, [0])
        cluster.wait_running(by_ip, [1])
        node = kube.get("Node", nodes[1])
        node["status"]["addresses"] = [{"type": "InternalIP", "address": "127.0.0.1"}]
        kube.patch("Node", nodes[1], {"status": node["status"]}, subresource="status")
        hooks = Hooks(addresses={nodes[0]: by_heartbeat.url})
        settings = kube_settings(
            make_settings,
            host_monitor_port=port,
            host_monitor_actuator_token=ACTUATOR_TOKEN,
            emergency_checkpoint_timeout_s=1.5,
        )
        async with started(kube, settings, hooks) as backend:
            await until(backend, lambda: backend.discovery.nodes_of("train") == nodes)
            result = await backend.execute(action(ActionType.EMERGENCY_CHECKPOINT))
            assert result["nodes"] == nodes and result["acked_ranks"] == ["0", "1"]
            assert events_about(kube, "train", "EmergencyCheckpoint")

            # Excluding the failed node: only the other one is asked.
            only = await backend.execute(
                action(ActionType.EMERGENCY_CHECKPOINT, key="k2", exclude_nodes=[nodes[0]])
            )
            assert only["nodes"] == [nodes[1]] and only["acked_ranks"] == ["1"]

            cluster.start_workers(by_ip, [2], env={"NO_ACK_RANKS": "2"})
            cluster.wait_running(by_ip, [2])
            with pytest.raises(ActionError, match=rf"{nodes[1]}: no answer from ranks \[2\]"):
                await backend.execute(action(ActionType.EMERGENCY_CHECKPOINT, key="k3"))
            assert events_about(kube, "train", "EmergencyCheckpointFailed")
    finally:
        cluster.teardown()


async def test_make_backend_builds_it_from_a_kubeconfig(
    kube: FakeKube, make_settings: SettingsFactory, tmp_path: Path
) -> None:
    """`backend: kubernetes` with `kube_config`: the supervisor's own factory builds the
    backend (the client from the kubeconfig and its context), which then acts."""
    kube.add_node("gpu-0", gpus=8, labels={"gpu": "true"})
    config = tmp_path / "kubeconfig"
    config.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": kube.url}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "ctx", "context": {"cluster": "fake", "user": "u"}}],
                "current-context": "other",
            }
        )
    )
    settings = kube_settings(make_settings, kube_config=str(config), kube_context="ctx")
    backend = make_backend(settings)
    assert isinstance(backend, KubeBackend)
    try:
        await backend.execute(action(ActionType.CORDON, node="gpu-0", job=None))
    finally:
        await backend.close()
    assert kube.get("Node", "gpu-0")["spec"]["unschedulable"] is True

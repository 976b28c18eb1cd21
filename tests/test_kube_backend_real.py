"""The Kubernetes backend's actions on the real control plane (tests/control_plane.py):
the real API server with its admission (the PodDisruptionBudget behind an eviction, the
JobSet webhook), the real Job and JobSet controllers restarting what the backend
disrupts, the scheduler placing the new pods, kwok playing the nodes' kubelets
(tests/kwok_pod_stages.yaml: a pod runs until deleted, then ends Failed as a kill ends
it). The backend holds the chart's ServiceAccount token, not an admin's: a verb the
chart's RBAC forgot fails the test with the API server's 403.

Each test keeps to nodes of its own (labelled `pool=<test>`, the backend's GPU node
selector) and a JobSet of its own name, so that they share one control plane.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from supervisor.actuator.backend import ActionError
from supervisor.domain import ActionRecord, ActionType
from supervisor.kube import objects as o
from supervisor.kube.backend import KubeBackend
from supervisor.runtime import make_backend
from tests.chart_rbac import chart_identity_without
from tests.conftest import SettingsFactory
from tests.control_plane import ControlPlane, Identity
from tests.kube.harness import Hooks, action, kube_settings
from tests.kube_real import (
    JOBSETS,
    NS,
    backend_on,
    events_about,
    get,
    job_uids,
    live_jobs,
    merge_patch,
    node,
    pool_nodes,
    start_jobset,
    unmanage,
    until,
    wait_running,
)
from tests.kube_real_supervising import Sent, wait
from tests.test_helm_chart import NAMESPACE
from tests.timing import scaled, wait_until


def evictions(sent: Sent) -> list[str]:
    """The pods whose eviction the backend sent, one entry per request, sorted."""
    return sorted(p.split("/")[-2] for _, p in sent.writes() if p.endswith("/eviction"))


async def repeat_writes_nothing(backend: KubeBackend, sent: Sent, done: ActionRecord) -> None:
    """The same action again: found done in its journal, not a single write sent."""
    before = len(sent)
    again = await backend.execute(done)
    assert again["repeated"] is True, again
    assert sent.writes(before) == []


# --- restarts through the JobSet controller ------------------------------------------------


async def test_restart_in_place_evicts_the_pod_and_the_jobset_controller_restarts_it(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    """The eviction (policy/v1) gives the pod DisruptionTarget; it ends Failed, its Job
    fails by its pod failure policy, and the real JobSet controller restarts the JobSet
    by the rule of "JobSet requirements", without counting it toward maxRestarts. The
    same action again writes nothing; Events on the pod and the JobSet say why."""
    pool_nodes(control_plane, "rip", 3)
    start_jobset(control_plane, "rip", "rip")
    pods = wait_running(control_plane, "rip", 2, "0")
    victim = pods[0]
    async with backend_on(control_plane, kube_supervisor, make_settings, "rip") as backend:
        sent = Sent(backend)
        await until(
            backend,
            lambda: victim["spec"]["nodeName"] in backend.discovery.nodes_of("rip"),
            "the pods seen",
        )
        a = action(
            ActionType.RESTART_IN_PLACE, job="rip", node=victim["spec"]["nodeName"], reason="exit"
        )
        result = await backend.execute(a)
        assert result == {"pods": {victim["metadata"]["name"]: "evicted"}}, result
        assert evictions(sent) == [victim["metadata"]["name"]]
        wait_running(control_plane, "rip", 2, "1")
        status = (get(control_plane, f"{JOBSETS}/rip") or {})["status"]
        assert status["restarts"] == 1, status
        assert status.get("restartsCountTowardsMax", 0) == 0, status
        assert events_about(control_plane, "rip", "RestartInPlace")
        (event,) = events_about(control_plane, victim["metadata"]["name"], "RestartInPlace")
        assert "supervisor action 1: exit" in event["message"], event
        await repeat_writes_nothing(backend, sent, a)


async def test_an_eviction_rbac_forbids_fails_the_action_saying_so_and_deletes_nothing(
    control_plane: ControlPlane, make_settings: SettingsFactory
) -> None:
    """The chart's RBAC less `create` on `pods/eviction`, as a cluster admin may trim it:
    the restart fails with the API server's 403 naming the verb and the resource, is not
    retried, and is not got around by deleting the pod (which would pass by the PDBs the
    eviction honours)."""
    trimmed = chart_identity_without(control_plane, "pods/eviction", "create")
    pool_nodes(control_plane, "rbac", 3)
    start_jobset(control_plane, "rbac", "rbac")
    pods = wait_running(control_plane, "rbac", 2, "0")
    victim = pods[0]
    async with backend_on(control_plane, trimmed, make_settings, "rbac") as backend:
        await until(
            backend,
            lambda: victim["spec"]["nodeName"] in backend.discovery.nodes_of("rbac"),
            "the pods seen",
        )
        a = action(
            ActionType.RESTART_IN_PLACE, job="rbac", node=victim["spec"]["nodeName"], reason="x"
        )
        with pytest.raises(ActionError) as refused:
            await backend.execute(a)
    said = str(refused.value)
    assert "HTTP 403" in said and 'cannot create resource "pods/eviction"' in said, said
    assert not refused.value.retryable
    still = get(control_plane, f"/api/v1/namespaces/{NS}/pods/{victim['metadata']['name']}")
    assert still is not None and "deletionTimestamp" not in still["metadata"], still


async def test_a_revoked_token_fails_the_action_saying_so(
    control_plane: ControlPlane, make_settings: SettingsFactory
) -> None:
    """The supervisor's ServiceAccount deleted under it (its token no longer valid, as an
    expired one): an action fails with the server's 401, and the backend, its watches
    failing meanwhile, closes as usual."""
    name = "supervisor-revoked"
    revoked = chart_identity_without(control_plane, "none", "none", name=name)
    (node_name,) = pool_nodes(control_plane, "revoked", 1)
    async with backend_on(control_plane, revoked, make_settings, "revoked") as backend:
        await until(backend, lambda: node_name in backend.discovery.nodes(), "the node seen")
        with control_plane.client() as api:
            r = api.delete(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{name}")
            assert r.status_code == 200, r.text
        # The API server keeps a token it authenticated for up to 10 s.
        deadline = asyncio.get_running_loop().time() + scaled(30)
        with control_plane.client(revoked) as as_revoked:
            while as_revoked.get("/api/v1/nodes").status_code != 401:
                assert asyncio.get_running_loop().time() < deadline, "the token still valid"
                await asyncio.sleep(0.5)
        with pytest.raises(ActionError) as refused:
            await backend.execute(action(ActionType.CORDON, node=node_name, job=None))
    said = str(refused.value)
    assert "HTTP 401" in said, said
    assert not node(control_plane, node_name)["spec"].get("unschedulable"), "cordoned anyway"


async def test_restart_workload_evicts_every_pod_and_returns_once_the_jobset_restarted(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    pool_nodes(control_plane, "rw", 2)
    start_jobset(control_plane, "rw", "rw")
    pods = wait_running(control_plane, "rw", 2, "0")
    old = {p["metadata"]["uid"] for p in pods}
    async with backend_on(control_plane, kube_supervisor, make_settings, "rw") as backend:
        sent = Sent(backend)
        await until(backend, lambda: len(backend.discovery.child_jobs("rw")) == 2, "the Jobs")
        old_jobs = job_uids(control_plane, "rw")
        a = action(ActionType.RESTART_WORKLOAD, job="rw", reason="hang")
        result = await backend.execute(a)
        assert result["method"] == "evict" and result["restart_attempt"] == 1, result
        assert result["pods"] == {p["metadata"]["name"]: "evicted" for p in pods}, result
        # Every pod evicted (UID preconditions), nothing deleted.
        assert evictions(sent) == sorted(result["pods"])
        assert [w for w in sent.writes() if w[0] == "DELETE"] == []
        # When execute returns, the JobSet has restarted: the Jobs of attempt 1 exist.
        jobs = live_jobs(control_plane, "rw")
        attempts = {j["metadata"]["labels"].get(o.RESTART_ATTEMPT) for j in jobs}
        assert attempts == {"1"}, attempts
        assert not {j["metadata"]["uid"] for j in jobs} & old_jobs
        new = {p["metadata"]["uid"] for p in wait_running(control_plane, "rw", 2, "1")}
        assert not new & old
        status = (get(control_plane, f"{JOBSETS}/rw") or {})["status"]
        assert status["restarts"] == 1, status
        assert status.get("restartsCountTowardsMax", 0) == 0, status
        (event,) = events_about(control_plane, "rw", "RestartWorkload")
        assert "restart-attempt 1" in event["message"], event
        await repeat_writes_nothing(backend, sent, a)


async def test_restart_workload_without_the_policy_deletes_the_jobs_for_the_controller(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    """No rule for PodFailurePolicy: failed Jobs would use up maxRestarts, so the child
    Jobs are deleted (Foreground) and the real JobSet controller creates them again; the
    JobSet's restart count is untouched."""
    pool_nodes(control_plane, "dj", 2)
    start_jobset(control_plane, "dj", "dj", failure_policy={"maxRestarts": 3})
    old = {p["metadata"]["uid"] for p in wait_running(control_plane, "dj", 2, "0")}
    async with backend_on(control_plane, kube_supervisor, make_settings, "dj") as backend:
        sent = Sent(backend)
        await until(backend, lambda: len(backend.discovery.child_jobs("dj")) == 2, "the Jobs")
        old_jobs = job_uids(control_plane, "dj")
        result = await backend.execute(action(ActionType.RESTART_WORKLOAD, job="dj", reason="hang"))
        assert result["method"] == "delete_jobs" and result["restart_attempt"] == 0, result
        assert result["deleted_jobs"] == ["dj-workers-0", "dj-workers-1"]
        deletes = [path for method, path in sent.writes() if method == "DELETE"]
        assert [d.rsplit("/", 1)[-1] for d in deletes] == result["deleted_jobs"], deletes
        new = {p["metadata"]["uid"] for p in wait_running(control_plane, "dj", 2, "0")}
        assert not new & old
        # The pods of new Jobs run: the JobSet controller created the Jobs again.
        jobs = job_uids(control_plane, "dj")
        assert len(jobs) == 2 and not jobs & old_jobs, jobs
        status = (get(control_plane, f"{JOBSETS}/dj") or {}).get("status", {})
        assert status.get("restarts", 0) == 0, status
        (event,) = events_about(control_plane, "dj", "RestartWorkload")
        assert "restart-attempt stays 0" in event["message"], event
        assert "gets RestartJobSet, not RestartJobSetAndIgnoreMaxRestarts" in event["message"]


# --- discovery and the backend's factory ---------------------------------------------------


async def test_discovery_maps_pods_nodes_spares_and_bounds(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    """Pods of the JobSet by node, spares (schedulable nodes of the GPU node selector with
    no JobSet pod), and replicas with bounds from the JobSet's annotations, falling back
    to the settings once the annotations go (a change the watches bring)."""
    nodes = pool_nodes(control_plane, "disc", 4)
    (cordoned,) = pool_nodes(control_plane, "disc-off", 1)
    merge_patch(
        control_plane,
        f"/api/v1/nodes/{cordoned}",
        {"metadata": {"labels": {"pool": "disc"}}, "spec": {"unschedulable": True}},
    )
    pool_nodes(control_plane, "disc-cpu", 1)  # not of the selector: never a spare
    start_jobset(
        control_plane, "disc", "disc", annotations={o.MIN_REPLICAS: "1", o.MAX_REPLICAS: "3"}
    )
    used = sorted(p["spec"]["nodeName"] for p in wait_running(control_plane, "disc", 2, "0"))
    async with backend_on(control_plane, kube_supervisor, make_settings, "disc") as backend:
        await until(backend, lambda: backend.discovery.nodes_of("disc") == used, "the pods")
        await until(
            backend, lambda: cordoned in backend.discovery.nodes(), "the cordoned node seen"
        )
        assert backend.discovery.spares() == sorted(set(nodes) - set(used))
        view = backend.job_views()["disc"]
        shape = (view.num_dp_replicas, view.min_num_dp_replicas, view.max_num_dp_replicas)
        assert shape == (2, 1, 3), shape
        assert view.num_nodes_per_dp == 1 and list(view.nodes) == used
        assert backend.discovery.jobset_on(used[0]) == "disc"

        # A change reaches the cache by the watch: annotations removed -> settings' bounds.
        gone = {"metadata": {"annotations": {o.MIN_REPLICAS: None, o.MAX_REPLICAS: None}}}
        merge_patch(control_plane, f"{JOBSETS}/disc", gone)
        settings = backend.settings
        await until(
            backend,
            lambda: (
                (
                    (v := backend.job_views()["disc"]).min_num_dp_replicas,
                    v.max_num_dp_replicas,
                )
                == (settings.min_num_dp_replicas, settings.max_num_dp_replicas)
            ),
            "the settings' bounds",
        )
        assert settings.max_num_dp_replicas != 3  # the change seen, not a coincidence
    # close() ended every watch thread.
    assert not [i for i in backend.discovery.informers.values() if i._thread.is_alive()]


async def test_make_backend_builds_it_from_a_kubeconfig(
    control_plane: ControlPlane,
    kube_supervisor: Identity,
    make_settings: SettingsFactory,
    tmp_path: Path,
) -> None:
    """`backend: kubernetes` with `kube_config` and `kube_context`: the supervisor's own
    factory builds the backend (the client from the kubeconfig and that context, not its
    current one, which names a server where nothing listens), which then acts."""
    (name,) = pool_nodes(control_plane, "mb", 1)
    config = yaml.safe_load(kube_supervisor.kubeconfig.read_text())
    (context,) = config["contexts"]
    (cluster,) = config["clusters"]
    context["name"] = "ctx"
    nowhere = {
        "name": "nowhere",
        "cluster": {**cluster["cluster"], "server": "https://127.0.0.1:9"},
    }
    config["clusters"].append(nowhere)
    config["contexts"].append(
        {"name": "other", "context": {**context["context"], "cluster": "nowhere"}}
    )
    config["current-context"] = "other"
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    settings = kube_settings(
        make_settings,
        kube_config=str(path),
        kube_context="ctx",
        kube_namespace=NS,
        kube_gpu_node_selector="pool=mb",
    )
    backend = make_backend(settings)
    assert isinstance(backend, KubeBackend)
    try:
        await backend.execute(action(ActionType.CORDON, node=name, job=None))
    finally:
        await backend.close()
    assert node(control_plane, name)["spec"]["unschedulable"] is True


# --- nodes ---------------------------------------------------------------------------------


async def test_hot_swap_moves_the_pod_to_a_spare_and_the_recovery_loop_gives_the_node_back(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    """Cordon, our NoExecute taint beside the node's own, the health label; the pod is
    evicted, and the restarted JobSet's pods are scheduled on the other nodes; a repeat
    writes nothing. The recovery loop asks for no uncordon while the node's host monitor
    is silent, and one once the node has been Ready and heartbeating for
    node_recovery_healthy_s; that uncordon gives the node back (the taint gone, the other
    kept), and the capacity back is said once. Nodes and JobSets are only ever patched
    (RBAC: no update verb)."""
    nodes = pool_nodes(control_plane, "hs", 3)
    start_jobset(control_plane, "hs", "hs")
    pods = wait_running(control_plane, "hs", 2, "0")
    bad = pods[0]["spec"]["nodeName"]
    other = {"key": "other", "value": "x", "effect": "NoSchedule"}
    merge_patch(control_plane, f"/api/v1/nodes/{bad}", {"spec": {"taints": [other]}})
    hooks = Hooks(heartbeating={bad: False})  # its host monitor silent: no recovery yet
    healthy_s = 0.5
    async with backend_on(
        control_plane,
        kube_supervisor,
        make_settings,
        "hs",
        hooks,
        node_recovery_healthy_s=healthy_s,
    ) as backend:
        sent = Sent(backend)
        await until(backend, lambda: bad in backend.discovery.nodes_of("hs"), "the pods seen")
        (spare,) = set(nodes) - {p["spec"]["nodeName"] for p in pods}
        settings = backend.settings
        swap = action(ActionType.HOT_SWAP, job="hs", node=bad, spare=spare, reason="xid 79")
        result = await backend.execute(swap)
        assert result["pods"] == {pods[0]["metadata"]["name"]: "evicted"}, result
        n = node(control_plane, bad)
        assert n["spec"]["unschedulable"] is True
        assert {t["key"] for t in n["spec"]["taints"]} >= {"other", settings.kube_taint_key}
        assert n["metadata"]["labels"][settings.kube_node_health_label] == o.PENDING_REPLACEMENT
        moved = wait_running(control_plane, "hs", 2, "1")
        assert bad not in {p["spec"]["nodeName"] for p in moved}
        assert events_about(control_plane, bad, "HotSwap")
        assert events_about(control_plane, "hs", "HotSwap")
        await repeat_writes_nothing(backend, sent, swap)

        # Ready but silent: not healthy, no uncordon asked for.
        assert backend.recovery is not None
        await backend.recovery.check()
        assert not backend.recovery.healthy(bad) and hooks.requests == []
        hooks.heartbeating[bad] = True
        assert backend.recovery.healthy(bad)
        heard = asyncio.get_running_loop().time()
        [(request, key)] = await wait(lambda: hooks.requests, "the uncordon asked for")
        assert asyncio.get_running_loop().time() - heard >= healthy_s
        assert request.type is ActionType.UNCORDON and request.node == bad, request

        await backend.execute(
            action(ActionType.UNCORDON, job=None, node=bad, key=key, id_=2, reason="healthy")
        )
        n = node(control_plane, bad)
        assert not n["spec"].get("unschedulable")
        assert settings.kube_taint_key not in {t["key"] for t in n["spec"].get("taints", [])}
        assert n["metadata"]["labels"][settings.kube_node_health_label] == o.SCHEDULABLE
        assert events_about(control_plane, bad, "Uncordon")
        # Schedulable again: capacity is back, said once.
        (recovered,) = await wait(lambda: hooks.of("node_recovered"), "node_recovered")
        await backend.recovery.check()
        assert hooks.of("node_recovered") == [recovered]
        assert recovered.node == bad and recovered.details["uncordoned_by"] == key
        assert [r for r in sent.requests if r[0] == "PUT"] == []
        # The node lifecycle controller's own taint of a cordoned node, which the uncordon
        # keeps as it found it (taints are written whole): the controller lifts it soon.
        wait_until(
            lambda: (
                [t["key"] for t in node(control_plane, bad)["spec"].get("taints", [])] == ["other"]
            ),
            "node.kubernetes.io/unschedulable lifted by the node lifecycle controller",
            30,
        )


async def test_cordon_and_uncordon_and_a_node_that_does_not_exist(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    (name,) = pool_nodes(control_plane, "cu", 1)
    async with backend_on(control_plane, kube_supervisor, make_settings, "cu") as backend:
        labels = backend.settings.kube_node_health_label
        await backend.execute(action(ActionType.CORDON, node=name, job=None))
        n = node(control_plane, name)
        assert n["spec"]["unschedulable"] is True
        assert n["metadata"]["labels"][labels] == o.UNSCHEDULABLE
        await backend.execute(action(ActionType.UNCORDON, node=name, job=None, key="k2"))
        n = node(control_plane, name)
        assert not n["spec"].get("unschedulable")
        assert n["metadata"]["labels"][labels] == o.SCHEDULABLE
        assert events_about(control_plane, name, "Cordon")
        assert events_about(control_plane, name, "Uncordon")
        with pytest.raises(ActionError, match="not found"):
            await backend.execute(action(ActionType.CORDON, node="cu-nope", job=None, key="k3"))


# --- scale down and up ---------------------------------------------------------------------


async def test_scale_down_then_up_recreates_the_jobset_and_restores_it_exactly(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    """Bounds come from the JobSet's annotations: outside them, refused, nothing written.
    The JobSet is deleted (Foreground) and created again from its own spec with fewer
    replicas (the real webhook keeps replicas immutable), NUM_DP_REPLICAS and NNODES set
    (the other variables kept), the bad node cordoned; a repeat writes nothing; scaling
    back up restores the spec the JobSet controller's webhook defaulted, exactly."""
    pool_nodes(control_plane, "sc", 3)
    start_jobset(
        control_plane,
        "sc",
        "sc",
        annotations={o.MIN_REPLICAS: "1"},
        env={"NNODES": "2", "X": "1"},
    )
    pods = wait_running(control_plane, "sc", 2, "0")
    bad = pods[0]["spec"]["nodeName"]
    original = get(control_plane, f"{JOBSETS}/sc") or {}
    async with backend_on(control_plane, kube_supervisor, make_settings, "sc") as backend:
        sent = Sent(backend)
        await until(backend, lambda: len(backend.discovery.nodes_of("sc")) == 2, "the pods")
        with pytest.raises(ActionError, match=r"outside \[1, 2\]"):
            await backend.execute(action(ActionType.SCALE_DOWN, job="sc", key="k0", to_replicas=0))
        assert sent.writes() == []
        down = action(
            ActionType.SCALE_DOWN, job="sc", to_replicas=1, exclude_node=bad, reason="no spare"
        )
        assert await backend.execute(down) == {"num_dp_replicas": 1, "from_replicas": 2}
        js = get(control_plane, f"{JOBSETS}/sc") or {}
        assert js["metadata"]["uid"] != original["metadata"]["uid"]
        assert js["spec"]["replicatedJobs"][0]["replicas"] == 1
        template = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in template["containers"][0]["env"]}
        assert env == {"NNODES": "1", "X": "1", "NUM_DP_REPLICAS": "1"}, env
        annotations = js["metadata"]["annotations"]
        assert annotations[o.NUM_DP_REPLICAS] == "1" and o.RECREATE not in annotations
        assert json.loads(annotations[o.ORIGINAL_SPEC]) == original["spec"]
        assert js["metadata"]["labels"] == original["metadata"]["labels"]
        assert node(control_plane, bad)["spec"]["unschedulable"] is True
        (pod,) = wait_running(control_plane, "sc", 1)
        assert pod["spec"]["nodeName"] != bad
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["NUM_DP_REPLICAS"] == "1" and env["NNODES"] == "1", env
        await until(
            backend,
            lambda: (
                (view := backend.job_views().get("sc")) is not None and view.num_dp_replicas == 1
            ),
            "one replica seen",
        )
        assert events_about(control_plane, "sc", "ScaleDown")
        await repeat_writes_nothing(backend, sent, down)

        up = action(ActionType.SCALE_UP, job="sc", key="k2", to_replicas=2, reason="back")
        assert await backend.execute(up) == {"num_dp_replicas": 2, "from_replicas": 1}
        restored = get(control_plane, f"{JOBSETS}/sc") or {}
        assert restored["spec"] == original["spec"]
        assert o.ORIGINAL_SPEC not in restored["metadata"]["annotations"]
        assert restored["metadata"]["annotations"][o.MIN_REPLICAS] == "1"
        wait_running(control_plane, "sc", 2)


# --- pods ----------------------------------------------------------------------------------


async def test_force_delete_removes_a_pod_whose_kubelet_is_gone(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    """A pod deleted on a node whose kubelet is gone (kwok no longer plays it) stays
    Terminating; the force delete (grace period 0, the pod's UID as precondition) removes
    it, and a repeat finds it gone."""
    pool_nodes(control_plane, "fd", 1)
    start_jobset(control_plane, "fd", "fd", replicas=1)
    (pod,) = wait_running(control_plane, "fd", 1)
    name, uid, where = pod["metadata"]["name"], pod["metadata"]["uid"], pod["spec"]["nodeName"]
    unmanage(control_plane, where)
    with control_plane.client() as api:
        assert api.delete(f"/api/v1/namespaces/{NS}/pods/{name}").status_code == 200
    path = f"/api/v1/namespaces/{NS}/pods/{name}"
    async with backend_on(control_plane, kube_supervisor, make_settings, "fd") as backend:
        a = action(ActionType.FORCE_DELETE_POD, job="fd", pod=name, namespace=NS, uid=uid)
        stuck = get(control_plane, path)
        assert stuck is not None and stuck["metadata"].get("deletionTimestamp")
        assert await backend.execute(a) == {"pod": name, "outcome": "deleted"}
        # The Job's tracking finalizer is the Job controller's to lift.
        wait_until(
            lambda: (p := get(control_plane, path)) is None or p["metadata"]["uid"] != uid,
            "the pod gone",
            30,
        )
        assert await backend.execute(a) == {"pod": name, "outcome": "gone"}


async def test_an_eviction_a_disruption_budget_refuses_falls_back_to_a_delete(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    """A real PodDisruptionBudget that allows no disruption: the API server answers the
    eviction 429 until eviction_patience_s is spent, then the pod is deleted with
    pod_deletion_grace_period_s."""
    pool_nodes(control_plane, "pdb", 2)
    start_jobset(control_plane, "pdb", "pdb")
    pods = wait_running(control_plane, "pdb", 2, "0")
    control_plane.apply(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "pdb-all", "namespace": NS},
            "spec": {"minAvailable": 2, "selector": {"matchLabels": {o.JOBSET_NAME: "pdb"}}},
        }
    )
    wait_until(
        lambda: (
            (
                get(control_plane, f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/pdb-all")
                or {}
            )
            .get("status", {})
            .get("currentHealthy")
            == 2
        ),
        "the budget counting both pods",
        30,
    )
    bad = pods[0]["spec"]["nodeName"]
    async with backend_on(
        control_plane, kube_supervisor, make_settings, "pdb", pod_deletion_grace_period_s=7
    ) as backend:
        await until(backend, lambda: bad in backend.discovery.nodes_of("pdb"), "the pods seen")
        sent = Sent(backend)
        result = await backend.execute(
            action(ActionType.RESTART_IN_PLACE, job="pdb", node=bad, reason="exit")
        )
        victim = pods[0]["metadata"]["name"]
        assert result == {"pods": {victim: "deleted"}}, result
        # Refused again and again (with backoff) for eviction_patience_s, then one delete,
        # with the grace period of the settings and the pod's UID as precondition.
        assert len(evictions(sent)) >= 3 and set(evictions(sent)) == {victim}, evictions(sent)
        deletes = [
            body
            for (method, path), body in zip(sent.requests, sent.bodies, strict=True)
            if method == "DELETE" and "/pods/" in path
        ]
        assert deletes == [
            {"gracePeriodSeconds": 7, "preconditions": {"uid": pods[0]["metadata"]["uid"]}}
        ], deletes
        wait_running(control_plane, "pdb", 2, "1")

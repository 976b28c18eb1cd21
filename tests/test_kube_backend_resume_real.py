"""The Kubernetes backend resumed after the supervisor crashed between an action's steps,
and a replica fenced off, on the real control plane (tests/control_plane.py): the real
API server, Job and JobSet controllers, scheduler and kwok, the backend as the chart's
ServiceAccount. What the backend sends is read where it leaves: through the fault proxy
(tests/kube_proxy.py), which records every request and answers what the real server
cannot be made to answer on demand (a create refused 503 until the fault is lifted).

Each test keeps to nodes of its own (labelled `pool=<test>`, the backend's GPU node
selector) and a JobSet of its own name, so that they share one control plane.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.actuator.backend import ActionError, Fenced
from supervisor.domain import ActionType
from supervisor.kube import objects as o
from tests.conftest import SettingsFactory
from tests.control_plane import ControlPlane, Identity
from tests.kube.harness import Hooks, action
from tests.kube_proxy import WRITES, Fault, KubeProxy
from tests.kube_real import (
    JOBSETS,
    NS,
    backend_on,
    events_about,
    get,
    merge_patch,
    node,
    pool_nodes,
    running,
    start_jobset,
    until,
    wait_running,
)

JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"


@pytest.fixture
def proxy(control_plane: ControlPlane) -> Iterator[KubeProxy]:
    with KubeProxy(control_plane) as p:
        yield p


def job_uids(plane: ControlPlane, name: str) -> set[str]:
    """The UIDs of the JobSet's child Jobs, none being deleted."""
    found = get(plane, f"{JOBS}?labelSelector={o.JOBSET_NAME}%3D{name}") or {}
    return {
        j["metadata"]["uid"] for j in found["items"] if not j["metadata"].get("deletionTimestamp")
    }


def sent_since(proxy: KubeProxy, before: int) -> list[tuple[str, str]]:
    """What the backend sent through the proxy from request `before` on, less its
    watches' own reconnects."""
    return [(m, p) for m, p in proxy.requests[before:] if "watch=" not in p]


async def test_restart_workload_resumed_after_a_crash_restarts_nothing_new(
    control_plane: ControlPlane,
    kube_supervisor: Identity,
    make_settings: SettingsFactory,
    proxy: KubeProxy,
    tmp_path: Path,
) -> None:
    """A crash after the pods were evicted, before the action was recorded finished: the
    repeat finds its journal entry (the old Jobs' UIDs) and the restart the JobSet
    controller did, so the new Jobs and pods are left alone; its one write is the
    journal's entry marked done on the JobSet (and the Event saying so)."""
    name = "rwc"
    pool_nodes(control_plane, name, 2)
    start_jobset(control_plane, name, name)
    wait_running(control_plane, name, 2, "0")
    config = proxy.kubeconfig(kube_supervisor, tmp_path / "kubeconfig")
    async with backend_on(
        control_plane, kube_supervisor, make_settings, name, kube_config=str(config)
    ) as backend:
        await until(backend, lambda: len(backend.discovery.child_jobs(name)) == 2, "the Jobs")
        a = action(ActionType.RESTART_WORKLOAD, job=name, key="crashy")
        first = await backend.execute(a)
        assert first["method"] == "evict" and first["restart_attempt"] == 1, first
        fresh = wait_running(control_plane, name, 2, "1")
        # Forget that it finished, as if the supervisor died before recording it.
        js = get(control_plane, f"{JOBSETS}/{name}") or {}
        journal = json.loads(js["metadata"]["annotations"][o.JOURNAL])
        assert journal["crashy"]["done"] is True, journal
        journal["crashy"]["done"] = False
        merge_patch(
            control_plane,
            f"{JOBSETS}/{name}",
            {"metadata": {"annotations": {o.JOURNAL: json.dumps(journal)}}},
        )
        jobs = job_uids(control_plane, name)
        assert len(jobs) == 2, jobs
        before = len(proxy.requests)
        result = await backend.execute(a)
        assert result == {"method": "evict", "pods": {}, "restart_attempt": 1}, result
        assert job_uids(control_plane, name) == jobs
        still = running(control_plane, name, 2, "1")
        assert {p["metadata"]["uid"] for p in still or []} == {p["metadata"]["uid"] for p in fresh}
        writes = [
            (m, p) for m, p in sent_since(proxy, before) if m in WRITES and "/events" not in p
        ]
        assert [(m, p.split("?", 1)[0]) for m, p in writes] == [("PATCH", f"{JOBSETS}/{name}")], (
            writes
        )
        status = (get(control_plane, f"{JOBSETS}/{name}") or {})["status"]
        assert status["restarts"] == 1, status  # the first restart, and no other


async def test_a_fenced_replica_sends_nothing(
    control_plane: ControlPlane,
    kube_supervisor: Identity,
    make_settings: SettingsFactory,
    proxy: KubeProxy,
    tmp_path: Path,
) -> None:
    """Once the fence says this replica may no longer act (its leadership lapsed), an
    action raises Fenced before sending any request: not a read, not its journal entry;
    the proxy in front of the API server saw nothing but the watches go on."""
    name = "fen"
    (spare, *_) = pool_nodes(control_plane, name, 3)
    start_jobset(control_plane, name, name)
    wait_running(control_plane, name, 2, "0")
    hooks = Hooks()
    config = proxy.kubeconfig(kube_supervisor, tmp_path / "kubeconfig")
    async with backend_on(
        control_plane, kube_supervisor, make_settings, name, hooks, kube_config=str(config)
    ) as backend:
        await until(backend, lambda: len(backend.discovery.child_jobs(name)) == 2, "the Jobs")
        hooks.fenced = "the Lease may be someone else's"
        before = len(proxy.requests)
        with pytest.raises(Fenced, match="someone else's"):
            await backend.execute(action(ActionType.RESTART_WORKLOAD, job=name))
        with pytest.raises(Fenced):
            await backend.execute(action(ActionType.CORDON, node=spare, job=None, key="k2"))
        assert sent_since(proxy, before) == []
    assert proxy.writes() == []
    annotations = (get(control_plane, f"{JOBSETS}/{name}") or {})["metadata"].get("annotations", {})
    assert o.JOURNAL not in annotations, annotations
    assert not node(control_plane, spare)["spec"].get("unschedulable")
    assert running(control_plane, name, 2, "0") is not None


async def test_scale_resumed_after_a_crash_between_delete_and_create(
    control_plane: ControlPlane,
    kube_supervisor: Identity,
    make_settings: SettingsFactory,
    proxy: KubeProxy,
    tmp_path: Path,
) -> None:
    """The old JobSet is gone and the supervisor that deleted it died before creating the
    new one (its create answered 503 by the proxy, every try): a new supervisor finds the
    new body on the Event recorded before the delete, and creates it."""
    name = "scr"
    pool_nodes(control_plane, name, 2)
    start_jobset(control_plane, name, name, annotations={o.MIN_REPLICAS: "1"})
    wait_running(control_plane, name, 2, "0")
    config = str(proxy.kubeconfig(kube_supervisor, tmp_path / "kubeconfig"))
    a = action(ActionType.SCALE_DOWN, job=name, to_replicas=1, reason="no spare")
    down = proxy.inject(Fault("POST", "/jobsets", status=503, times=1000))
    async with backend_on(
        control_plane, kube_supervisor, make_settings, name, kube_config=config
    ) as backend:
        await until(backend, lambda: len(backend.discovery.nodes_of(name)) == 2, "the pods")
        with pytest.raises(ActionError, match=f"create jobset {name}: HTTP 503") as e:
            await backend.execute(a)
        assert e.value.retryable
    assert down.hits >= 1
    assert get(control_plane, f"{JOBSETS}/{name}") is None
    down.times = down.hits
    async with backend_on(
        control_plane, kube_supervisor, make_settings, name, kube_config=config
    ) as fresh:
        assert await fresh.execute(a) == {"num_dp_replicas": 1, "from_replicas": 2}
    js = get(control_plane, f"{JOBSETS}/{name}") or {}
    assert js["spec"]["replicatedJobs"][0]["replicas"] == 1, js
    wait_running(control_plane, name, 1)
    assert len(events_about(control_plane, name, "Rescaling")) == 1

"""The Kubernetes backend resumed after the supervisor crashed between an action's steps,
and a replica fenced off, on the real control plane (tests/control_plane.py): the real
API server, Job and JobSet controllers, scheduler and kwok, the backend as the chart's
ServiceAccount. What the backend sends is read where it leaves: through the fault proxy
(tests/kube_proxy.py), which records every request and answers what the real server
cannot be made to answer on demand (a create refused 503 until the fault is lifted).
Each test keeps to a pool of nodes and a JobSet of its own (tests/kube_real.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path

import pytest

from supervisor.actuator.backend import ActionError, Fenced
from supervisor.domain import ActionType
from supervisor.kube import objects as o
from supervisor.kube.backend import KubeBackend
from tests import kube_real as real
from tests.conftest import SettingsFactory
from tests.control_plane import ControlPlane, Identity
from tests.kube.harness import Hooks, action
from tests.kube_proxy import WRITES, Fault, KubeProxy


@dataclass
class Proxied:
    """The backend as the chart's ServiceAccount, through the fault proxy."""

    plane: ControlPlane
    who: Identity
    make_settings: SettingsFactory
    proxy: KubeProxy
    kubeconfig: Path

    def backend(
        self, pool: str, hooks: Hooks | None = None
    ) -> AbstractAsyncContextManager[KubeBackend]:
        """The backend seeing the nodes of `pool` as its GPU nodes; started, then closed."""
        config = str(self.kubeconfig)
        return real.backend_on(
            self.plane, self.who, self.make_settings, pool, hooks, kube_config=config
        )

    def sent_since(self, before: int) -> list[tuple[str, str]]:
        """What the backend sent through the proxy from request `before` on, less its
        watches' own reconnects and the conditional writes the API server refused with 409
        Conflict: the object changed since it was read (the JobSet controller updates
        the JobSet as its restart goes on), so the backend read it again and sent the
        write again, and the refused one changed nothing."""
        proxy = self.proxy
        sent = zip(proxy.requests[before:], proxy.statuses[before:], strict=True)
        return [(m, p) for (m, p), status in sent if "watch=" not in p and status != 409]


@pytest.fixture
def proxied(
    control_plane: ControlPlane,
    kube_supervisor: Identity,
    make_settings: SettingsFactory,
    tmp_path: Path,
) -> Iterator[Proxied]:
    with KubeProxy(control_plane) as proxy:
        config = proxy.kubeconfig(kube_supervisor, tmp_path / "kubeconfig")
        yield Proxied(control_plane, kube_supervisor, make_settings, proxy, config)


async def test_restart_workload_resumed_after_a_crash_restarts_nothing_new(
    control_plane: ControlPlane, proxied: Proxied
) -> None:
    """A crash after the pods were evicted, before the action was recorded finished: the
    repeat finds its journal entry (the old Jobs' UIDs) and the restart the JobSet
    controller did, so the new Jobs and pods are left alone; its one write is the
    journal's entry marked done on the JobSet (and the Event saying so)."""
    name = "rwc"
    real.running_jobset(control_plane, name)
    async with proxied.backend(name) as backend:
        await real.until(backend, lambda: len(backend.discovery.child_jobs(name)) == 2, "the Jobs")
        a = action(ActionType.RESTART_WORKLOAD, job=name, key="crashy")
        first = await backend.execute(a)
        assert first["method"] == "evict" and first["restart_attempt"] == 1, first
        fresh = real.wait_running(control_plane, name, 2, "1")
        # Forget that it finished, as if the supervisor died before recording it.
        js = real.get(control_plane, f"{real.JOBSETS}/{name}") or {}
        journal = json.loads(js["metadata"]["annotations"][o.JOURNAL])
        assert journal["crashy"]["done"] is True, journal
        journal["crashy"]["done"] = False
        real.merge_patch(
            control_plane,
            f"{real.JOBSETS}/{name}",
            {"metadata": {"annotations": {o.JOURNAL: json.dumps(journal)}}},
        )
        jobs = real.job_uids(control_plane, name)
        assert len(jobs) == 2, jobs
        before = len(proxied.proxy.requests)
        result = await backend.execute(a)
        assert result == {"method": "evict", "pods": {}, "restart_attempt": 1}, result
        assert real.job_uids(control_plane, name) == jobs
        still = real.running(control_plane, name, 2, "1")
        assert {p["metadata"]["uid"] for p in still or []} == {p["metadata"]["uid"] for p in fresh}
        writes = [
            (m, p) for m, p in proxied.sent_since(before) if m in WRITES and "/events" not in p
        ]
        paths = [(m, p.split("?", 1)[0]) for m, p in writes]
        assert paths == [("PATCH", f"{real.JOBSETS}/{name}")], writes
        status = (real.get(control_plane, f"{real.JOBSETS}/{name}") or {})["status"]
        assert status["restarts"] == 1, status  # the first restart, and no other


async def test_a_fenced_replica_sends_nothing(
    control_plane: ControlPlane, proxied: Proxied
) -> None:
    """Once the fence says this replica may no longer act (its leadership lapsed), an
    action raises Fenced before sending any request: not a read, not its journal entry;
    the proxy in front of the API server saw nothing but the watches go on."""
    name = "fen"
    pods = real.running_jobset(control_plane, name, 3)
    (spare,) = {f"{name}-{i}" for i in range(3)} - {p["spec"]["nodeName"] for p in pods}
    hooks = Hooks()
    async with proxied.backend(name, hooks) as backend:
        await real.until(backend, lambda: len(backend.discovery.child_jobs(name)) == 2, "the Jobs")
        hooks.fenced = "the Lease may be someone else's"
        before = len(proxied.proxy.requests)
        with pytest.raises(Fenced, match="someone else's"):
            await backend.execute(action(ActionType.RESTART_WORKLOAD, job=name))
        with pytest.raises(Fenced):
            await backend.execute(action(ActionType.CORDON, node=spare, job=None, key="k2"))
        assert proxied.sent_since(before) == []
    assert proxied.proxy.writes() == []
    js = real.get(control_plane, f"{real.JOBSETS}/{name}") or {}
    annotations = js["metadata"].get("annotations", {})
    assert o.JOURNAL not in annotations, annotations
    assert not real.node(control_plane, spare)["spec"].get("unschedulable")
    assert real.running(control_plane, name, 2, "0") is not None


async def test_scale_resumed_after_a_crash_between_delete_and_create(
    control_plane: ControlPlane, proxied: Proxied
) -> None:
    """The old JobSet is gone and the supervisor that deleted it died before creating the
    new one (its create answered 503 by the proxy, every try): a new supervisor finds the
    new body on the Event recorded before the delete, and creates it."""
    name = "scr"
    real.running_jobset(control_plane, name, annotations={o.MIN_REPLICAS: "1"})
    a = action(ActionType.SCALE_DOWN, job=name, to_replicas=1, reason="no spare")
    down = proxied.proxy.inject(Fault("POST", "/jobsets", status=503, times=1000))
    async with proxied.backend(name) as backend:
        await real.until(backend, lambda: len(backend.discovery.nodes_of(name)) == 2, "the pods")
        with pytest.raises(ActionError, match=f"create jobset {name}: HTTP 503") as e:
            await backend.execute(a)
        assert e.value.retryable
    assert down.hits >= 1
    assert real.get(control_plane, f"{real.JOBSETS}/{name}") is None
    down.times = down.hits
    async with proxied.backend(name) as fresh:
        assert await fresh.execute(a) == {"num_dp_replicas": 1, "from_replicas": 2}
    js = real.get(control_plane, f"{real.JOBSETS}/{name}") or {}
    assert js["spec"]["replicatedJobs"][0]["replicas"] == 1, js
    real.wait_running(control_plane, name, 1)
    assert len(real.events_about(control_plane, name, "Rescaling")) == 1

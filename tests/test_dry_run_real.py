"""A dry-run supervisor on Kubernetes, on the real control plane (tests/control_plane.py):
it watches the cluster (read only) as the chart's ServiceAccount, decides from what it
sees, and writes nothing. "Nothing" is read from what it sent: it reaches the API server
through a proxy of the test (tests/kube_proxy.py) that records every request.

Each test keeps to nodes of its own (labelled `pool=<its tag>`, the supervisor's GPU node
selector) and a JobSet of its own name, so that the tests share the session's plane.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.actuator import ActionError, DryRunBackend
from supervisor.api import create_app
from supervisor.config import Settings
from supervisor.domain import ActionType
from supervisor.kube import objects as o
from supervisor.kube.backend import KubeBackend
from supervisor.kube.client import api_client
from supervisor.runtime import Supervisor, make_backend
from tests.conftest import AGENT_TOKEN, OPERATOR_TOKEN, SettingsFactory
from tests.control_plane import ControlPlane, Identity
from tests.kube.harness import Hooks, action, kube_settings
from tests.kube_proxy import KubeProxy
from tests.kube_real import JOBSETS, NS, get, node, pool_nodes, set_ready, start_jobset, unmanage
from tests.kube_real import wait_running as wait_pods
from tests.timing import scaled

AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
tags = itertools.count()


@pytest.fixture
def proxy(control_plane: ControlPlane) -> Iterator[KubeProxy]:
    with KubeProxy(control_plane) as p:
        yield p


def dry_settings(
    make_settings: SettingsFactory,
    who: Identity,
    proxy: KubeProxy,
    tmp_path: Path,
    pool: str,
    **overrides: Any,
) -> Settings:
    """A dry run with the Kubernetes backend, as the chart's ServiceAccount through the
    proxy, seeing the nodes of `pool` as its GPU nodes."""
    return kube_settings(
        make_settings,
        dry_run=True,
        kube_config=str(proxy.kubeconfig(who, tmp_path / "kubeconfig")),
        kube_namespace=NS,
        kube_gpu_node_selector=f"pool={pool}",
        pod_termination_threshold_s=scaled(60),
        **overrides,
    )


def read_only(proxy: KubeProxy) -> None:
    """The supervisor listed and watched (through the proxy), and sent nothing else."""
    assert proxy.writes() == []
    watched = {p.split("?", 1)[0] for m, p in proxy.requests if m == "GET" and "watch=" in p}
    assert "/api/v1/nodes" in watched, watched
    assert f"/api/v1/namespaces/{NS}/pods" in watched, watched


async def test_dry_run_on_kubernetes_builds_a_read_only_watcher(
    control_plane: ControlPlane,
    kube_supervisor: Identity,
    proxy: KubeProxy,
    pool: str,
    make_settings: SettingsFactory,
    tmp_path: Path,
) -> None:
    """The supervisor's own factory: dry run with `backend: kubernetes` keeps the
    Kubernetes backend, read only, under the recording one; it watches, and refuses to
    act."""
    (gpu,) = pool_nodes(control_plane, pool, 1)
    backend = make_backend(dry_settings(make_settings, kube_supervisor, proxy, tmp_path, pool))
    assert isinstance(backend, DryRunBackend)
    watching = backend.watching
    assert isinstance(watching, KubeBackend) and watching.read_only
    try:
        await backend.start(Hooks().hooks())
        assert await watching.discovery.wait_until(
            lambda: gpu in watching.discovery.nodes(), scaled(30)
        ), "the node seen"
        cordon = action(ActionType.CORDON, node=gpu, job=None)
        assert await backend.execute(cordon) == {"dry_run": True}
        with pytest.raises(ActionError, match="only watches"):
            await watching.execute(cordon)
    finally:
        await backend.close()
    read_only(proxy)
    assert not node(control_plane, gpu)["spec"].get("unschedulable")


async def _wait(predicate: Any, timeout: float = 30.0) -> Any:
    deadline = asyncio.get_running_loop().time() + scaled(timeout)
    while True:
        value = await predicate()
        if value:
            return value
        assert asyncio.get_running_loop().time() < deadline, "condition not met"
        await asyncio.sleep(0.1)


async def test_a_dry_run_supervisor_decides_from_the_cluster_and_writes_nothing(
    control_plane: ControlPlane,
    kube_supervisor: Identity,
    proxy: KubeProxy,
    pool: str,
    make_settings: SettingsFactory,
    tmp_path: Path,
) -> None:
    """The real app in dry run with the Kubernetes backend: the JobSet's bounds and the
    spare come from the cluster watch, a node going NotReady is sensed, a lost node is
    'hot-swapped' to the spare on record only, and the API server is sent no write: the
    JobSet is as it was, and no node cordoned or tainted."""
    job = pool
    nodes = pool_nodes(control_plane, pool, 3)
    start_jobset(control_plane, job, pool, annotations={o.MIN_REPLICAS: "1"})
    pods = wait_pods(control_plane, job, 2, "0")
    used = sorted(p["spec"]["nodeName"] for p in pods)
    (spare,) = set(nodes) - set(used)
    bad = used[0]
    before = as_written(control_plane, job)
    settings = dry_settings(
        make_settings,
        kube_supervisor,
        proxy,
        tmp_path,
        pool,
        heartbeat_timeout_s=1.5,
        heartbeat_polling_period_s=0.2,
        max_workload_restarts=0,
    )
    watching = KubeBackend(
        settings, api_client(settings), request_timeout_s=10.0, watch_timeout_s=30, read_only=True
    )
    supervisor = Supervisor(settings, backend=DryRunBackend(watching=watching))
    app = create_app(settings, supervisor)

    def beat(node: str, step: int) -> dict[str, Any]:
        if node == spare:
            return {"node": node, "state": "spare", "address": "http://127.0.0.1:9"}
        rank = used.index(node)
        worker = {"rank": rank, "local_rank": 0, "pid": 10 + rank, "state": "running", "step": step}
        return {
            "node": node,
            "state": "running",
            "job": job,
            "workers": [worker],
            "address": "http://127.0.0.1:9",
        }

    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            silent: set[str] = set()

            async def beating() -> None:
                step = 0
                while True:
                    step += 1
                    for node in (*used, spare):
                        if node not in silent:
                            await http.post(
                                "/api/v1/heartbeats", json=beat(node, step), headers=AGENT
                            )
                    await asyncio.sleep(0.2)

            beats = asyncio.create_task(beating())
            try:

                async def job_view() -> dict[str, Any] | None:
                    r = await http.get(f"/api/v1/jobs/{job}", headers=OPERATOR)
                    body: dict[str, Any] = r.json()
                    return body if r.status_code == 200 and body["nodes"] else None

                view = await _wait(job_view)
                assert view["min_num_dp_replicas"] == 1  # from the JobSet's annotation
                # Kubernetes sensing stays on in dry run: the node's kubelet says NotReady.
                unmanage(control_plane, used[1])
                set_ready(control_plane, used[1], False)

                async def not_ready() -> list[dict[str, Any]]:
                    r = await http.get(
                        "/api/v1/events", params={"type": "node_not_ready"}, headers=OPERATOR
                    )
                    items: list[dict[str, Any]] = r.json()["items"]
                    return items

                [event] = await _wait(not_ready)
                assert event["node"] == used[1]

                async def swaps(count: int) -> list[dict[str, Any]] | None:
                    r = await http.get(
                        "/api/v1/actions",
                        params={"type": "hot_swap", "dry_run": "true"},
                        headers=OPERATOR,
                    )
                    done = [a for a in r.json()["items"] if a["status"] == "succeeded"]
                    return done[::-1] if len(done) >= count else None

                # The default policy's answer to a node gone NotReady, on record only.
                [first] = await _wait(lambda: swaps(1))
                assert first["node"] == used[1] and first["params"]["spare"] == spare
                assert first["dry_run"] is True and first["result"] == {"dry_run": True}
                set_ready(control_plane, used[1], True)
                silent.add(bad)  # its host monitor stops: lost, swapped (on record)
                second = (await _wait(lambda: swaps(2)))[1]
                assert second["node"] == bad and second["params"]["spare"] == spare
                assert second["dry_run"] is True
                live = await http.get(
                    "/api/v1/actions", params={"dry_run": "false"}, headers=OPERATOR
                )
                assert live.json()["items"] == []
            finally:
                beats.cancel()
                await asyncio.gather(beats, return_exceptions=True)
    # Nothing was written: no cordon, no taint, no eviction, no Kubernetes event.
    read_only(proxy)
    assert as_written(control_plane, job) == before  # not patched, not restarted
    still = wait_pods(control_plane, job, 2, "0")
    assert {p["metadata"]["uid"] for p in still} == {p["metadata"]["uid"] for p in pods}
    for name in nodes:
        spec = node(control_plane, name)["spec"]
        assert not spec.get("unschedulable"), name
        assert not [t for t in spec.get("taints") or [] if t["key"] == settings.kube_taint_key]


def as_written(plane: ControlPlane, job: str) -> tuple[Any, ...]:
    """What a write to the JobSet would change (its status aside, which its controller
    keeps: the pods of a NotReady node are marked not ready)."""
    js = get(plane, f"{JOBSETS}/{job}") or {}
    meta = js["metadata"]
    return meta["generation"], meta.get("annotations"), meta.get("labels"), js["spec"]


@pytest.fixture
def pool(control_plane: ControlPlane) -> Iterator[str]:
    """The test's tag: its pool's and its JobSet's name; both deleted at its end."""
    tag = f"dry{next(tags)}"
    yield tag
    with control_plane.client() as api:
        api.delete(f"{JOBSETS}/{tag}", params={"propagationPolicy": "Background"})
        api.delete("/api/v1/nodes", params={"labelSelector": f"pool={tag}"})

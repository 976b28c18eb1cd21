"""A pod on a NotReady node is deleted with grace 0 only once its node is known down:
the node carries `node.kubernetes.io/out-of-service`, or the setting
`kube_platform_fences_nodes` says the platform fences nodes itself. On the real control
plane (tests/control_plane.py), the backend holding the chart's ServiceAccount token: the
real node lifecycle controller taints a NotReady node and its taint eviction deletes the
pods there, and a node whose kubelet is gone (kwok no longer plays it, or the test
kubelet's node died) never confirms a pod's end.

Each test keeps to nodes of its own (labelled `pool=<test>`) and a JobSet of its own
name, so that they share one control plane.
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from supervisor.actuator.backend import ActionError
from supervisor.domain import ActionType
from supervisor.kube import objects as o
from supervisor.kube.backend import KubeBackend
from supervisor.kube.node_fencing import OUT_OF_SERVICE
from tests.conftest import SettingsFactory
from tests.control_plane import ControlPlane, Identity
from tests.http import http
from tests.kube.harness import action, jobset
from tests.kube_real import (
    JOBSETS,
    NS,
    add_taint,
    backend_on,
    get,
    pool_nodes,
    set_ready,
    unmanage,
    until,
    wait_running,
)
from tests.kube_real_fixtures import started, tags, wait_for
from tests.test_host_monitor import OPERATOR
from tests.timing import scaled, wait_until

FENCED = {"key": OUT_OF_SERVICE, "value": "nodeshutdown", "effect": "NoExecute"}


def start_jobset(plane: ControlPlane, name: str, **js: Any) -> None:
    """The JobSet of "JobSet requirements" on the nodes of pool `name`, its pods
    tolerating a NotReady or unreachable node for no time: the taint eviction deletes
    them as soon as the node lifecycle controller taints their node (without the
    toleration, the API server's DefaultTolerationSeconds gives them 300 s)."""
    body = jobset(name, **js)
    body["metadata"]["namespace"] = NS
    pod = body["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["nodeSelector"] = {"pool": name}
    pod["tolerations"] = [
        {"key": f"node.kubernetes.io/{k}", "operator": "Exists", "effect": "NoExecute"}
        | {"tolerationSeconds": 0}
        for k in ("not-ready", "unreachable")
    ]
    plane.apply(body)


def pod_path(name: str) -> str:
    return f"/api/v1/namespaces/{NS}/pods/{name}"


def gone(plane: ControlPlane, name: str, uid: str) -> bool:
    """The pod is no more (the Job controller lifted its tracking finalizer)."""
    pod = get(plane, pod_path(name))
    return pod is None or pod["metadata"]["uid"] != uid


def not_ready(plane: ControlPlane, node: str) -> None:
    """The node's kubelet stops posting Ready (down, or only unreachable: nobody can
    tell): kwok no longer plays it, its Ready condition False."""
    unmanage(plane, node)
    set_ready(plane, node, False)


def cut_off(plane: ControlPlane, pool: str) -> tuple[str, str, str]:
    """The node of the JobSet's first pod stops posting Ready. The node lifecycle
    controller taints it, the taint eviction deletes its pod, which stays terminating: no
    kubelet confirms its end. (pod, uid, node)."""
    pool_nodes(plane, pool, 4)
    start_jobset(plane, pool)
    pod = wait_running(plane, pool, 2)[0]
    name, uid, node = pod["metadata"]["name"], pod["metadata"]["uid"], pod["spec"]["nodeName"]
    not_ready(plane, node)
    wait_until(
        lambda: (p := get(plane, pod_path(name))) is not None and o.terminating(p),
        "the taint eviction deleting the pod",
        60,
    )
    return name, uid, node


def cached(backend: KubeBackend, kind: str, key: str) -> dict[str, Any] | None:
    item: dict[str, Any] | None = backend.discovery.informers[kind].items.get(key)
    return item


async def test_a_pod_on_a_not_ready_node_waits_for_the_out_of_service_taint(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    pool = "oos"
    name, uid, node = cut_off(control_plane, pool)
    async with backend_on(control_plane, kube_supervisor, make_settings, pool) as backend:
        await until(backend, lambda: (p := cached(backend, "Pod", f"{NS}/{name}")) is not None
                    and o.terminating(p), "the pod seen terminating")  # fmt: skip
        a = action(ActionType.FORCE_DELETE_POD, job=pool, pod=name, namespace=NS, uid=uid)
        with pytest.raises(ActionError, match=OUT_OF_SERVICE) as refused:
            await backend.execute(a)
        assert not refused.value.retryable
        assert f"node {node} is NotReady but not known to be down" in str(refused.value)
        assert get(control_plane, pod_path(name)) is not None  # still there: it may still run

        # Someone made sure the node is down, and says so the way Kubernetes asks.
        add_taint(control_plane, node, FENCED)
        await until(backend, lambda: o.has_taint(cached(backend, "Node", node) or {},
                                                 OUT_OF_SERVICE), "the taint seen")  # fmt: skip
        assert await backend.execute(a) == {"pod": name, "outcome": "deleted"}
        wait_until(lambda: gone(control_plane, name, uid), "the pod gone", 30)


async def test_a_platform_that_fences_nodes_lets_them_go_at_once(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    pool = "fenced"
    name, uid, _ = cut_off(control_plane, pool)
    async with backend_on(
        control_plane, kube_supervisor, make_settings, pool, kube_platform_fences_nodes=True
    ) as backend:
        await until(backend, lambda: (p := cached(backend, "Pod", f"{NS}/{name}")) is not None
                    and o.terminating(p), "the pod seen terminating")  # fmt: skip
        a = action(ActionType.FORCE_DELETE_POD, job=pool, pod=name, namespace=NS, uid=uid)
        assert await backend.execute(a) == {"pod": name, "outcome": "deleted"}
        wait_until(lambda: gone(control_plane, name, uid), "the pod gone", 30)


async def test_a_scale_down_deletes_a_down_nodes_pods_only_once_it_is_known_down(
    control_plane: ControlPlane, kube_supervisor: Identity, make_settings: SettingsFactory
) -> None:
    """Scaling a JobSet away from a lost node recreates it once its old pods are gone; the
    pod on the NotReady node never goes by itself. Not known down: the scale fails naming
    why (and is retried); with the out-of-service taint it deletes that pod with grace 0 and
    completes."""
    pool = "sdoos"
    pool_nodes(control_plane, pool, 4)
    start_jobset(control_plane, pool, annotations={o.MIN_REPLICAS: "1"})
    pod = wait_running(control_plane, pool, 2)[0]
    name, uid, node = pod["metadata"]["name"], pod["metadata"]["uid"], pod["spec"]["nodeName"]
    not_ready(control_plane, node)
    # The old pods go through the garbage collector's foreground deletion, the Job
    # controller and kwok: seconds on a loaded machine (the model's 1 s was too short).
    threshold = scaled(10)
    async with backend_on(
        control_plane, kube_supervisor, make_settings, pool, pod_termination_threshold_s=threshold
    ) as backend:
        await until(backend, lambda: len(backend.discovery.nodes_of(pool)) == 2, "both pods seen")
        a = action(
            ActionType.SCALE_DOWN, job=pool, to_replicas=1, exclude_node=node, reason="no spare"
        )
        with pytest.raises(ActionError, match=f"pods of {node}: node {node} is NotReady") as e:
            await backend.execute(a)
        assert e.value.retryable
        assert get(control_plane, pod_path(name)) is not None  # it may still run

        add_taint(control_plane, node, FENCED)
        await until(backend, lambda: o.has_taint(cached(backend, "Node", node) or {},
                                                 OUT_OF_SERVICE), "the taint seen")  # fmt: skip
        assert await backend.execute(a) == {"num_dp_replicas": 1, "from_replicas": 2}
        assert gone(control_plane, name, uid)
        js = get(control_plane, f"{JOBSETS}/{pool}")
        assert js is not None and js["spec"]["replicatedJobs"][0]["replicas"] == 1


@pytest.mark.skipif(find_spec("torch") is None, reason="the in-process JobSet runs torch")
def test_an_in_process_heal_waits_for_a_node_not_known_down(
    control_plane: ControlPlane, kube_supervisor: Identity, tmp_path: Path
) -> None:
    """The node of rank 0 of the in-process PyTorch JobSet stops answering (NotReady, its
    host monitor silent: down or cut off, nobody can tell). The hot-swap does not delete
    its pod with grace 0, and its error says so. Once the node carries the out-of-service
    taint, the pod's force delete goes through."""
    from tests.kube_real_in_process import RealInProcess, training

    class Unfenced(RealInProcess):
        def supervisor_env(self) -> dict[str, str]:
            return {
                **super().supervisor_env(),
                "SUPERVISOR_KUBE_PLATFORM_FENCES_NODES": "false",
                "SUPERVISOR_IN_PROCESS_RESTART_TIMEOUT_S": "10",
            }

    with started(Unfenced(control_plane, kube_supervisor, tmp_path, f"pk{next(tags)}")) as env:
        lost = training(env, past=20)[0]
        name, uid = lost["metadata"]["name"], lost["metadata"]["uid"]
        node = lost["spec"]["nodeName"]
        env.node_dies(node)

        def swapped() -> list[dict[str, Any]]:
            return [a for a in env.actions("hot_swap") if a["status"] in ("succeeded", "failed")]

        (swap,) = wait_for(swapped, 180, "the hot-swap")
        # Neither healed in-process (the old pod is kept, so its rank is not replaced) nor
        # by a restart (its Job cannot go while the pod is there): the error says why.
        assert swap["status"] == "failed", swap
        assert f"node {node} is NotReady but not known to be down" in swap["error"], swap
        pod = env.pod(name)
        assert pod is not None and o.terminating(pod)  # it may still run: kept

        # Someone makes sure the node is down and says so the way Kubernetes asks: the
        # stuck pod's force delete then goes through.
        add_taint(control_plane, node, FENCED)
        body = {
            "type": "force_delete_pod",
            "job": env.job,
            "node": node,
            "params": {"pod": name, "namespace": NS, "uid": uid},
            "reason": "the node is out of service",
        }
        r = http.post(
            f"{env.supervisor.url}/api/v1/actions",
            json=body,
            headers={**OPERATOR, "Idempotency-Key": "fenced-node"},
        )
        assert r.status_code in (200, 201, 202), r.text
        wait_for(lambda: gone(control_plane, name, uid), 60, "the pod force-deleted")
        (done,) = wait_for(
            lambda: [a for a in env.settled() if a["reason"] == body["reason"]], 30, "its action"
        )
        assert done["status"] == "succeeded", done

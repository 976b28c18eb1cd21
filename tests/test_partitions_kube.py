"""A pod on a NotReady node is deleted with grace 0 only once its node is known down:
the node carries `node.kubernetes.io/out-of-service`, or the setting
`kube_platform_fences_nodes` says the platform fences nodes itself. Through the official
client over HTTP against the fake API server (tests/kube), which models the node
lifecycle's taint eviction and a kubelet that, on a NotReady node, never confirms a pod's
end (as on a real cluster)."""

from __future__ import annotations

from collections.abc import Iterator
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
from tests.http import http
from tests.kube import FakeKube
from tests.kube.harness import NS, action, kube_settings, setup_cluster, started
from tests.kube_model_e2e import wait_for
from tests.test_host_monitor import OPERATOR


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube(time_scale=0.01, bookmark_interval=0.1, tick=0.02) as k:
        yield k


def cut_off(kube: FakeKube) -> tuple[str, str, str]:
    """The node of the JobSet's first pod stops posting Ready (down, or only unreachable:
    nobody can tell). Taint eviction deletes its pod, which stays terminating: no kubelet
    confirms its end. (pod, uid, node)."""
    pods = setup_cluster(kube)
    pod = pods[0]
    name, uid, node = pod["metadata"]["name"], pod["metadata"]["uid"], pod["spec"]["nodeName"]
    kube.set_node_ready(node, False)
    kube.wait_for(lambda: (p := kube.get("Pod", name)) is not None and o.terminating(p), 10)
    return name, uid, node


async def until(backend: KubeBackend, predicate: Any) -> None:
    assert await backend.discovery.wait_until(predicate, 10.0), "condition not met"


def cached(backend: KubeBackend, kind: str, key: str) -> dict[str, Any] | None:
    item: dict[str, Any] | None = backend.discovery.informers[kind].items.get(key)
    return item


async def test_a_pod_on_a_not_ready_node_waits_for_the_out_of_service_taint(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    name, uid, node = cut_off(kube)
    async with started(kube, kube_settings(make_settings)) as backend:
        await until(backend, lambda: (p := cached(backend, "Pod", f"{NS}/{name}")) is not None
                    and o.terminating(p))  # fmt: skip
        a = action(ActionType.FORCE_DELETE_POD, pod=name, namespace=NS, uid=uid)
        with pytest.raises(ActionError, match=OUT_OF_SERVICE) as refused:
            await backend.execute(a)
        assert not refused.value.retryable
        assert f"node {node} is NotReady but not known to be down" in str(refused.value)
        assert kube.get("Pod", name) is not None  # still there: it may still run

        # Someone made sure the node is down, and says so the way Kubernetes asks.
        taints = (kube.get("Node", node) or {})["spec"].get("taints") or []
        taint = {"key": OUT_OF_SERVICE, "value": "nodeshutdown", "effect": "NoExecute"}
        kube.patch("Node", node, {"spec": {"taints": [*taints, taint]}})
        await until(backend, lambda: o.has_taint(cached(backend, "Node", node) or {},
                                                 OUT_OF_SERVICE))  # fmt: skip
        assert await backend.execute(a) == {"pod": name, "outcome": "deleted"}
        kube.wait_for(lambda: kube.get("Pod", name) is None, 5)


async def test_a_platform_that_fences_nodes_lets_them_go_at_once(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    name, uid, _ = cut_off(kube)
    settings = kube_settings(make_settings, kube_platform_fences_nodes=True)
    async with started(kube, settings) as backend:
        await until(backend, lambda: (p := cached(backend, "Pod", f"{NS}/{name}")) is not None
                    and o.terminating(p))  # fmt: skip
        a = action(ActionType.FORCE_DELETE_POD, pod=name, namespace=NS, uid=uid)
        assert await backend.execute(a) == {"pod": name, "outcome": "deleted"}
        kube.wait_for(lambda: kube.get("Pod", name) is None, 5)


async def test_a_scale_down_deletes_a_down_nodes_pods_only_once_it_is_known_down(
    kube: FakeKube, make_settings: SettingsFactory
) -> None:
    """Scaling a JobSet away from a lost node recreates it once its old pods are gone; the
    pod on the NotReady node never goes by itself. Not known down: the scale fails naming
    why (and is retried); with the out-of-service taint it deletes that pod with grace 0 and
    completes."""
    pods = setup_cluster(kube, annotations={o.MIN_REPLICAS: "1"})
    name, node = pods[0]["metadata"]["name"], pods[0]["spec"]["nodeName"]
    kube.set_node_ready(node, False)
    settings = kube_settings(make_settings, pod_termination_threshold_s=1.0)
    async with started(kube, settings) as backend:
        await until(backend, lambda: len(backend.discovery.nodes_of("train")) == 2)
        a = action(ActionType.SCALE_DOWN, to_replicas=1, exclude_node=node, reason="no spare")
        with pytest.raises(ActionError, match=f"pods of {node}: node {node} is NotReady") as e:
            await backend.execute(a)
        assert e.value.retryable
        assert kube.get("Pod", name) is not None  # it may still run

        taints = (kube.get("Node", node) or {})["spec"].get("taints") or []
        taint = {"key": OUT_OF_SERVICE, "value": "nodeshutdown", "effect": "NoExecute"}
        kube.patch("Node", node, {"spec": {"taints": [*taints, taint]}})
        await until(backend, lambda: o.has_taint(cached(backend, "Node", node) or {},
                                                 OUT_OF_SERVICE))  # fmt: skip
        assert await backend.execute(a) == {"num_dp_replicas": 1, "from_replicas": 2}
        assert kube.get("Pod", name) is None
        js = kube.get("JobSet", "train")
        assert js is not None and js["spec"]["replicatedJobs"][0]["replicas"] == 1


@pytest.mark.skipif(find_spec("torch") is None, reason="the in-process JobSet runs torch")
def test_an_in_process_heal_waits_for_a_node_not_known_down(tmp_path: Path) -> None:
    """The node of rank 0 of the in-process PyTorch JobSet stops answering (NotReady, its
    host monitor silent: down or cut off, nobody can tell). The hot-swap does not delete
    its pod with grace 0, and its error says so. Once the node carries the out-of-service
    taint, the pod's force delete goes through."""
    from tests.test_kube_in_process import JOB, Env, training

    class Unfenced(Env):
        def supervisor_env(self) -> dict[str, str]:
            return {
                **super().supervisor_env(),
                "SUPERVISOR_KUBE_PLATFORM_FENCES_NODES": "false",
                "SUPERVISOR_IN_PROCESS_RESTART_TIMEOUT_S": "10",
            }

    env = Unfenced(tmp_path)
    try:
        env.start()
        lost = training(env, past=20)[0]
        name, node = lost["metadata"]["name"], lost["spec"]["nodeName"]
        env.node_dies(node)

        def swapped() -> list[dict[str, Any]]:
            return [a for a in env.actions("hot_swap") if a["status"] in ("succeeded", "failed")]

        (swap,) = wait_for(swapped, 180, "the hot-swap")
        # Neither healed in-process (the old pod is kept, so its rank is not replaced) nor
        # by a restart (its Job cannot go while the pod is there): the error says why.
        assert swap["status"] == "failed", swap
        assert f"node {node} is NotReady but not known to be down" in swap["error"], swap
        pod = env.kube.get("Pod", name)
        assert pod is not None and o.terminating(pod)  # it may still run: kept

        # Someone makes sure the node is down and says so the way Kubernetes asks: the
        # stuck pod's force delete then goes through.
        taints = (env.kube.get("Node", node) or {})["spec"].get("taints") or []
        taint = {"key": OUT_OF_SERVICE, "value": "nodeshutdown", "effect": "NoExecute"}
        env.kube.patch("Node", node, {"spec": {"taints": [*taints, taint]}})
        body = {
            "type": "force_delete_pod",
            "job": JOB,
            "node": node,
            "params": {"pod": name, "namespace": "default", "uid": pod["metadata"]["uid"]},
            "reason": "the node is out of service",
        }
        r = http.post(
            f"{env.supervisor.url}/api/v1/actions",
            json=body,
            headers={**OPERATOR, "Idempotency-Key": "fenced-node"},
        )
        assert r.status_code in (200, 201, 202), r.text
        wait_for(lambda: env.kube.get("Pod", name) is None, 60, "the pod force-deleted")
    finally:
        env.stop()

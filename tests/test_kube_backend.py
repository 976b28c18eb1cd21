"""The Kubernetes backend through the official client over HTTP against the model of the
API server (tests/kube), for what a real one cannot be made to do on demand: 429 with its
Retry-After, 500 and 503 on chosen requests, a conflict on one chosen write, slow answers
ending in the request timeout, a watch cut by errors and resumed from a compacted
resourceVersion, bookmarks keeping a quiet watch resumable. The actions themselves run on
the real control plane (tests/test_kube_backend_real.py)."""

from __future__ import annotations

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
    action,
    kube_settings,
    running_pods,
    setup_cluster,
    started,
)


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube(time_scale=0.01, bookmark_interval=0.1, tick=0.02) as k:
        yield k


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

"""The fake Kubernetes API server (tests/kube), exercised only through the official client.

Each test asserts a behaviour of the real kube-apiserver (or of the real controller
behind it) that the Kubernetes backend depends on; the docstrings say which one.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from tests.kube import FakeKube

NS = "default"
GROUP, VERSION, PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
JS_LABEL = "jobset.sigs.k8s.io/"


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube(time_scale=0.01, bookmark_interval=0.1, tick=0.02) as k:
        yield k


@pytest.fixture
def api(kube: FakeKube) -> Iterator[Any]:
    with kube.client() as c:
        yield c


def new_watch() -> Any:
    return watch.Watch()  # type: ignore[no-untyped-call]


def _api(cls: Any, api_client: Any) -> Any:
    """An API object, typed Any: the client's models make every field Optional."""
    return cls(api_client)


def status_of(e: ApiException) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(e.body or "")
    assert body["kind"] == "Status" and body["status"] == "Failure"
    assert body["code"] == e.status
    return body


def pod_body(
    name: str,
    labels: dict[str, str] | None = None,
    *,
    gpus: int = 0,
    grace: int = 30,
    tolerations: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": "trainer:1"}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    spec: dict[str, Any] = {"containers": [container], "terminationGracePeriodSeconds": grace}
    if tolerations:
        spec["tolerations"] = tolerations
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": spec,
    }


def running_pods(kube: FakeKube, selector: str | None = None) -> list[dict[str, Any]]:
    return [
        p
        for p in kube.objects("Pod", NS, label_selector=selector)
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]


def jobset_body(
    name: str,
    *,
    replicas: int = 2,
    parallelism: int = 2,
    max_restarts: int | None = 3,
    suspend: bool = False,
    gpus: int = 8,
    grace: int = 5,
) -> dict[str, Any]:
    pod_spec = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": grace,
        "containers": [
            {
                "name": "main",
                "image": "trainer:1",
                "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
            }
        ],
    }
    spec: dict[str, Any] = {
        "suspend": suspend,
        "replicatedJobs": [
            {
                "name": "workers",
                "replicas": replicas,
                "template": {
                    "spec": {
                        "parallelism": parallelism,
                        "completions": parallelism,
                        "backoffLimit": 0,
                        "template": {"spec": pod_spec},
                    }
                },
            }
        ],
    }
    if max_restarts is not None:
        spec["failurePolicy"] = {"maxRestarts": max_restarts}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "JobSet",
        "metadata": {"name": name},
        "spec": spec,
    }


def jobset_pods(kube: FakeKube, name: str, attempt: int) -> list[dict[str, Any]]:
    return running_pods(kube, f"{JS_LABEL}jobset-name={name},{JS_LABEL}restart-attempt={attempt}")


def jobset_pods_when(kube: FakeKube, name: str, attempt: int, count: int) -> list[dict[str, Any]]:
    """The running pods of that restart attempt once there are ``count`` of them, else []."""
    pods = jobset_pods(kube, name, attempt)
    return pods if len(pods) == count else []


# --- basics: metadata, errors, auth ---------------------------------------------------------


def test_bearer_token_is_checked() -> None:
    """A request with a wrong bearer token is 401 Unauthorized (a Status, reason Unauthorized)."""
    with FakeKube(token="s3cret") as kube:
        with kube.client(token="wrong") as bad, pytest.raises(ApiException) as e:
            _api(client.CoreV1Api, bad).list_node()
        assert e.value.status == 401 and status_of(e.value)["reason"] == "Unauthorized"
        with kube.client() as good:
            assert _api(client.CoreV1Api, good).list_node().items == []


def test_create_sets_metadata_and_resets_pod_status(kube: FakeKube, api: Any) -> None:
    """Create assigns uid, creationTimestamp, generation 1 and a resourceVersion from one
    global counter; a pod's status is reset to phase Pending (pod strategy PrepareForCreate)."""
    core = _api(client.CoreV1Api, api)
    body = pod_body("p1")
    body["status"] = {"phase": "Running"}
    a = core.create_namespaced_pod(NS, body)
    b = core.create_namespaced_pod(NS, pod_body("p2"))
    assert a.metadata.uid and a.metadata.creation_timestamp is not None
    assert a.metadata.generation == 1
    assert int(b.metadata.resource_version) > int(a.metadata.resource_version)
    assert a.status.phase == "Pending"
    assert a.spec.termination_grace_period_seconds == 30
    generated = core.create_namespaced_pod(
        NS, {**pod_body(""), "metadata": {"generateName": "gen-"}}
    )
    assert generated.metadata.name.startswith("gen-") and len(generated.metadata.name) == 9


def test_quantities_come_back_as_strings(kube: FakeKube, api: Any) -> None:
    """Resource quantities sent as JSON numbers (a manifest's YAML `8`, applied as it is:
    the client's models would refuse it) come back as the server writes them ("8",
    "500m"), in pods and in Jobs' pod templates; requests default to the limits."""
    core = _api(client.CoreV1Api, api)
    body = pod_body("q")
    body["spec"]["containers"][0]["resources"] = {
        "limits": {"nvidia.com/gpu": 8, "cpu": 0.5},
        "requests": {"memory": "1Gi"},
    }
    kube.create(body, namespace=NS)
    pod = core.read_namespaced_pod("q", NS)
    assert pod.spec.containers[0].resources.limits == {"nvidia.com/gpu": "8", "cpu": "500m"}
    assert pod.spec.containers[0].resources.requests == {
        "memory": "1Gi",
        "nvidia.com/gpu": "8",
        "cpu": "500m",
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "qj"},
        "spec": {"template": {"spec": {**body["spec"], "restartPolicy": "Never"}}},
    }
    kube.create(job, namespace=NS)
    created = _api(client.BatchV1Api, api).read_namespaced_job("qj", NS)
    limits = created.spec.template.spec.containers[0].resources.limits
    assert limits == {"nvidia.com/gpu": "8", "cpu": "500m"}


def test_already_exists_and_not_found_are_status_objects(api: Any) -> None:
    """409 AlreadyExists on a duplicate create; 404 NotFound on get/delete/patch of a missing
    object, with the real messages and details."""
    core = _api(client.CoreV1Api, api)
    core.create_namespaced_pod(NS, pod_body("dup"))
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod(NS, pod_body("dup"))
    s = status_of(e.value)
    assert (e.value.status, s["reason"], s["message"]) == (
        409,
        "AlreadyExists",
        'pods "dup" already exists',
    )
    for call in (
        lambda: core.read_namespaced_pod("nope", NS),
        lambda: core.delete_namespaced_pod("nope", NS),
        lambda: core.patch_namespaced_pod("nope", NS, {"metadata": {"labels": {"a": "b"}}}),
    ):
        with pytest.raises(ApiException) as e:
            call()  # type: ignore[no-untyped-call]
        s = status_of(e.value)
        assert (e.value.status, s["reason"], s["message"]) == (
            404,
            "NotFound",
            'pods "nope" not found',
        )
        assert s["details"] == {"name": "nope", "kind": "pods"}
    with pytest.raises(ApiException) as e:
        _api(client.BatchV1Api, api).read_namespaced_job("nope", NS)
    assert status_of(e.value)["message"] == 'jobs.batch "nope" not found'


def test_stale_resource_version_is_409_conflict(api: Any) -> None:
    """PUT with a stale metadata.resourceVersion, or a patch carrying one, is 409 Conflict
    ("the object has been modified; please apply your changes to the latest version")."""
    coord = _api(client.CoordinationV1Api, api)
    lease = client.V1Lease(
        metadata=client.V1ObjectMeta(name="l"), spec=client.V1LeaseSpec(holder_identity="a")
    )
    created = coord.create_namespaced_lease(NS, lease)
    created.spec.holder_identity = "b"
    updated = coord.replace_namespaced_lease("l", NS, created)
    assert int(updated.metadata.resource_version) > int(created.metadata.resource_version)
    created.spec.holder_identity = "c"
    with pytest.raises(ApiException) as e:
        coord.replace_namespaced_lease("l", NS, created)  # still the old resourceVersion
    s = status_of(e.value)
    assert e.value.status == 409 and s["reason"] == "Conflict"
    assert s["message"] == (
        'Operation cannot be fulfilled on leases.coordination.k8s.io "l": '
        "the object has been modified; "
        "please apply your changes to the latest version and try again"
    )
    stale = {
        "metadata": {"resourceVersion": created.metadata.resource_version},
        "spec": {"holderIdentity": "d"},
    }
    with pytest.raises(ApiException) as e:
        coord.patch_namespaced_lease("l", NS, stale)
    assert e.value.status == 409
    assert coord.read_namespaced_lease("l", NS).spec.holder_identity == "b"


def test_update_preconditions_and_unconditional_updates(api: Any) -> None:
    """Built-in kinds accept a PUT without resourceVersion (unconditional update); custom
    resources refuse it (422 "must be specified for an update"); a uid that is not the
    stored one is 409 "Precondition failed: UID in precondition"; a no-op write does not
    change the resourceVersion."""
    coord = _api(client.CoordinationV1Api, api)
    lease = coord.create_namespaced_lease(
        NS, {"metadata": {"name": "l"}, "spec": {"holderIdentity": "a"}}
    )
    body = api.sanitize_for_serialization(lease)
    body["metadata"].pop("resourceVersion")
    body["spec"]["holderIdentity"] = "b"
    updated = coord.replace_namespaced_lease("l", NS, body)
    assert updated.spec.holder_identity == "b"
    assert (
        coord.replace_namespaced_lease("l", NS, body).metadata.resource_version
        == updated.metadata.resource_version
    )
    body["metadata"]["uid"] = "00000000-0000-0000-0000-000000000000"
    with pytest.raises(ApiException) as e:
        coord.replace_namespaced_lease("l", NS, body)
    assert (
        e.value.status == 409
        and "Precondition failed: UID in precondition" in status_of(e.value)["message"]
    )

    co = _api(client.CustomObjectsApi, api)
    js = co.create_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, jobset_body("js", suspend=True)
    )
    js["metadata"].pop("resourceVersion")
    with pytest.raises(ApiException) as e:
        co.replace_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "js", js)
    s = status_of(e.value)
    assert (e.value.status, s["reason"]) == (422, "Invalid")
    assert (
        "metadata.resourceVersion: Invalid value: 0x0: must be specified for an update"
        in s["message"]
    )


def test_status_subresource_and_generation(kube: FakeKube, api: Any) -> None:
    """With a status subresource, writes to the object ignore status and writes to /status
    ignore everything but status; metadata.generation moves only when the spec changes."""
    co = _api(client.CustomObjectsApi, api)
    co.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, jobset_body("js", suspend=True))
    js = co.patch_namespaced_custom_object(
        GROUP,
        VERSION,
        NS,
        PLURAL,
        "js",
        {"metadata": {"labels": {"a": "b"}}, "status": {"restarts": 7}},
    )
    assert js["metadata"]["generation"] == 1 and js.get("status", {}).get("restarts") != 7
    js = co.patch_namespaced_custom_object_status(
        GROUP, VERSION, NS, PLURAL, "js", {"spec": {"suspend": False}, "status": {"restarts": 7}}
    )
    assert (
        js["status"]["restarts"] == 7
        and js["spec"]["suspend"] is True
        and js["metadata"]["generation"] == 1
    )
    js = co.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "js", {"spec": {"suspend": False}}
    )
    assert js["metadata"]["generation"] == 2


# --- selectors -------------------------------------------------------------------------------

LABELLED = {
    "a": {"app": "train", "tier": "gpu", "rank": "0"},
    "b": {"app": "train", "tier": "cpu", "rank": "1"},
    "c": {"app": "serve"},
    "d": {},
}


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("app=train", "ab"),
        ("app==train", "ab"),
        ("app!=train", "cd"),
        ("tier in (gpu, cpu)", "ab"),
        ("tier notin (gpu)", "bcd"),
        ("tier", "ab"),
        ("!tier", "cd"),
        ("app=train,tier=gpu", "a"),
        ("rank>0", "b"),
        ("", "abcd"),
    ],
)
def test_label_selectors(kube: FakeKube, api: Any, selector: str, expected: str) -> None:
    """labels.Parse semantics: =, ==, !=, in, notin, exists, !key, gt; != and notin also match
    objects without the key; requirements are ANDed."""
    core = _api(client.CoreV1Api, api)
    for name, labels in LABELLED.items():
        kube.create(pod_body(name, labels))
    got = "".join(
        sorted(p.metadata.name for p in core.list_namespaced_pod(NS, label_selector=selector).items)
    )
    assert got == expected


def test_bad_selectors_are_400(api: Any) -> None:
    """A malformed label selector, or a field label the kind does not support, is 400 BadRequest."""
    core = _api(client.CoreV1Api, api)
    with pytest.raises(ApiException) as e:
        core.list_namespaced_pod(NS, label_selector="app in (a")
    assert e.value.status == 400 and status_of(e.value)["reason"] == "BadRequest"
    with pytest.raises(ApiException) as e:
        core.list_namespaced_pod(NS, field_selector="spec.foo=bar")
    assert (
        e.value.status == 400
        and 'field label not supported: "spec.foo"' in status_of(e.value)["message"]
    )


def test_field_selectors(kube: FakeKube, api: Any) -> None:
    """Field selectors metadata.name, metadata.namespace, spec.nodeName, status.phase (=, ==, !=),
    on namespaced and all-namespaces lists, and spec.unschedulable on nodes."""
    kube.add_node("n1")
    kube.add_node("n2", unschedulable=True)
    kube.create(pod_body("a"))
    kube.create(pod_body("b"))
    kube.create({**pod_body("c"), "metadata": {"name": "c", "namespace": "other"}})
    kube.wait_for(lambda: len(running_pods(kube)) == 2)
    core = _api(client.CoreV1Api, api)

    def names(items: list[Any]) -> list[str]:
        return sorted(i.metadata.name for i in items)

    assert names(core.list_namespaced_pod(NS, field_selector="metadata.name=a").items) == ["a"]
    assert names(
        core.list_pod_for_all_namespaces(field_selector="metadata.namespace=other").items
    ) == ["c"]
    assert names(
        core.list_pod_for_all_namespaces(field_selector="metadata.namespace!=other").items
    ) == ["a", "b"]
    assert names(core.list_namespaced_pod(NS, field_selector="spec.nodeName=n1").items) == [
        "a",
        "b",
    ]
    assert names(
        core.list_namespaced_pod(NS, field_selector="status.phase==Running,metadata.name!=a").items
    ) == ["b"]
    assert names(core.list_node(field_selector="spec.unschedulable=true").items) == ["n2"]


def test_list_pagination_and_expired_continue(kube: FakeKube, api: Any) -> None:
    """limit/continue paginate (metadata.continue, remainingItemCount); a continue token older
    than the compaction point is 410 Expired."""
    for i in range(5):
        kube.create(pod_body(f"p{i}"))
    core = _api(client.CoreV1Api, api)
    first = core.list_namespaced_pod(NS, limit=2)
    assert [p.metadata.name for p in first.items] == ["p0", "p1"]
    assert first.metadata.remaining_item_count == 3
    rest = core.list_namespaced_pod(NS, limit=10, _continue=first.metadata._continue)
    assert [p.metadata.name for p in rest.items] == [
        "p2",
        "p3",
        "p4",
    ] and not rest.metadata._continue
    kube.create(pod_body("late"))
    kube.compact()
    with pytest.raises(ApiException) as e:
        core.list_namespaced_pod(NS, limit=2, _continue=first.metadata._continue)
    assert e.value.status == 410 and status_of(e.value)["reason"] == "Expired"


# --- patches ----------------------------------------------------------------------------------


def test_patch_node_uses_strategic_merge(kube: FakeKube, api: Any) -> None:
    """CoreV1Api.patch_node with a dict body sends application/strategic-merge-patch+json.
    Labels/annotations merge, null deletes a key, spec.unschedulable is set; spec.taints has no
    patch merge key (listType=atomic), so a patch replaces the whole list."""
    kube.add_node(
        "n1", labels={"keep": "1", "drop": "1"}, taints=[{"key": "other", "effect": "NoSchedule"}]
    )
    core = _api(client.CoreV1Api, api)
    node = core.patch_node(
        "n1",
        {
            "metadata": {"labels": {"health": "bad", "drop": None}, "annotations": {"why": "xid"}},
            "spec": {
                "unschedulable": True,
                "taints": [{"key": "supervisor/unhealthy", "effect": "NoExecute"}],
            },
        },
    )
    assert kube.requests[-1].content_type == "application/strategic-merge-patch+json"
    assert node.metadata.labels["keep"] == "1" and node.metadata.labels["health"] == "bad"
    assert "drop" not in node.metadata.labels and node.metadata.annotations == {"why": "xid"}
    assert node.spec.unschedulable is True
    assert [t.key for t in node.spec.taints] == ["supervisor/unhealthy"]


def test_strategic_merge_merges_pod_conditions_by_type(kube: FakeKube, api: Any) -> None:
    """status.conditions of a Pod has patchMergeKey "type": a strategic merge patch updates or
    appends one condition and keeps the others; labels merge."""
    kube.add_node("n1")
    kube.create(pod_body("p", {"a": "1"}))
    kube.wait_for(lambda: running_pods(kube))
    core = _api(client.CoreV1Api, api)
    before = [c.type for c in core.read_namespaced_pod("p", NS).status.conditions]
    cond = {"type": "supervisor/Healthy", "status": "False", "reason": "Xid79"}
    pod = core.patch_namespaced_pod_status("p", NS, {"status": {"conditions": [cond]}})
    assert [c.type for c in pod.status.conditions] == [*before, "supervisor/Healthy"]
    cond["status"] = "True"
    pod = core.patch_namespaced_pod_status("p", NS, {"status": {"conditions": [cond]}})
    assert [c.status for c in pod.status.conditions if c.type == "supervisor/Healthy"] == ["True"]
    pod = core.patch_namespaced_pod("p", NS, {"metadata": {"labels": {"b": "2"}}})
    assert pod.metadata.labels == {"a": "1", "b": "2"}


def test_json_patch(kube: FakeKube, api: Any) -> None:
    """A list body makes the client send application/json-patch+json (RFC 6902): add, replace,
    remove, test; an operation that does not apply is 422 and changes nothing."""
    kube.add_node("n1", taints=[{"key": "a", "effect": "NoSchedule"}])
    core = _api(client.CoreV1Api, api)
    node = core.patch_node(
        "n1",
        [
            {"op": "add", "path": "/spec/taints/-", "value": {"key": "b", "effect": "NoExecute"}},
            {"op": "add", "path": "/metadata/labels/x~1y", "value": "1"},
            {"op": "replace", "path": "/spec/taints/0/effect", "value": "PreferNoSchedule"},
        ],
    )
    assert kube.requests[-1].content_type == "application/json-patch+json"
    assert [(t.key, t.effect) for t in node.spec.taints] == [
        ("a", "PreferNoSchedule"),
        ("b", "NoExecute"),
    ]
    assert node.metadata.labels["x/y"] == "1"
    node = core.patch_node("n1", [{"op": "remove", "path": "/spec/taints/0"}])
    assert [t.key for t in node.spec.taints] == ["b"]
    rv = node.metadata.resource_version
    with pytest.raises(ApiException) as e:
        core.patch_node("n1", [{"op": "test", "path": "/spec/unschedulable", "value": True}])
    assert e.value.status == 422
    assert core.read_node("n1").metadata.resource_version == rv


def test_custom_objects_use_merge_patch(api: Any) -> None:
    """CustomObjectsApi.patch_namespaced_custom_object sends application/merge-patch+json
    (RFC 7386: lists are replaced, null deletes); custom resources refuse strategic merge: 415."""
    co = _api(client.CustomObjectsApi, api)
    co.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, jobset_body("js", suspend=True))
    js = co.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "js", {"metadata": {"annotations": {"a": "1", "b": "2"}}}
    )
    js = co.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "js", {"metadata": {"annotations": {"b": None}}}
    )
    assert js["metadata"]["annotations"] == {"a": "1"}
    with pytest.raises(ApiException) as e:
        co.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            NS,
            PLURAL,
            "js",
            {"spec": {"suspend": False}},
            _content_type="application/strategic-merge-patch+json",
        )
    assert e.value.status == 415 and status_of(e.value)["reason"] == "UnsupportedMediaType"


# --- watch ------------------------------------------------------------------------------------


def test_watch_events_bookmarks_and_timeout(kube: FakeKube, api: Any) -> None:
    """A watch from resourceVersion N streams ADDED/MODIFIED/DELETED for changes after N,
    BOOKMARKs carrying the latest resourceVersion (allowWatchBookmarks), and ends after
    timeoutSeconds."""
    core = _api(client.CoreV1Api, api)
    kube.create(pod_body("before"))
    rv = core.list_namespaced_pod(NS).metadata.resource_version

    def writer() -> None:
        time.sleep(0.15)
        core.create_namespaced_pod(NS, pod_body("p"))
        core.patch_namespaced_pod("p", NS, {"metadata": {"labels": {"x": "1"}}})
        core.delete_namespaced_pod("p", NS)  # unscheduled: deleted at once

    t = threading.Thread(target=writer)
    t.start()
    started = time.monotonic()
    seen: list[tuple[str, str | None]] = []
    bookmarks: list[str] = []
    w = new_watch()
    for ev in w.stream(
        core.list_namespaced_pod,
        NS,
        resource_version=rv,
        allow_watch_bookmarks=True,
        timeout_seconds=1,
    ):
        if ev["type"] == "BOOKMARK":
            bookmarks.append(ev["raw_object"]["metadata"]["resourceVersion"])
        else:
            seen.append((ev["type"], ev["object"].metadata.name))
    elapsed = time.monotonic() - started
    t.join()
    # The scheduler may add MODIFIED events of its own (PodScheduled=False, no nodes), to
    # "p" and, on a loaded machine, to "before" after its resourceVersion was read.
    others = [e for e in seen if e[1] != "p"]
    assert set(others) <= {("MODIFIED", "before")}
    seen = [e for e in seen if e[1] == "p"]
    assert seen[0] == ("ADDED", "p") and seen[-1] == ("DELETED", "p")
    assert set(seen[1:-1]) == {("MODIFIED", "p")}
    assert bookmarks and int(bookmarks[-1]) == kube.resource_version
    assert 0.9 <= elapsed < 2.5


def test_watch_without_resource_version_starts_with_current_state(kube: FakeKube, api: Any) -> None:
    """Without resourceVersion a watch first sends an ADDED event for every current object."""
    kube.create(pod_body("a"))
    kube.create(pod_body("b"))
    core = _api(client.CoreV1Api, api)
    w = new_watch()
    events = []
    for e in w.stream(core.list_namespaced_pod, NS, timeout_seconds=5):
        events.append((e["type"], e["object"].metadata.name))
        if len(events) == 2:
            w.stop()
    assert events == [("ADDED", "a"), ("ADDED", "b")]
    # sendInitialEvents=true (watch-list): the initial state, then a BOOKMARK annotated
    # k8s.io/initial-events-end, then changes.
    w = new_watch()
    seen: list[tuple[str, Any]] = []
    for e in w.stream(
        core.list_namespaced_pod,
        NS,
        send_initial_events=True,
        resource_version_match="NotOlderThan",
        allow_watch_bookmarks=True,
        timeout_seconds=5,
    ):
        md = e["raw_object"]["metadata"]
        seen.append((e["type"], md.get("name") or md.get("annotations")))
        if e["type"] == "BOOKMARK":
            w.stop()
    assert seen == [
        ("ADDED", "a"),
        ("ADDED", "b"),
        ("BOOKMARK", {"k8s.io/initial-events-end": "true"}),
    ]


def test_watch_custom_objects(kube: FakeKube, api: Any) -> None:
    """Watching JobSets through CustomObjectsApi yields dict objects, status updates included."""
    co = _api(client.CustomObjectsApi, api)
    rv = co.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL)["metadata"]["resourceVersion"]
    co.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, jobset_body("js", suspend=True))
    w = new_watch()
    seen = []
    for e in w.stream(
        co.list_namespaced_custom_object,
        GROUP,
        VERSION,
        NS,
        PLURAL,
        resource_version=rv,
        timeout_seconds=5,
    ):
        seen.append(e["type"])
        if e["object"].get("status", {}).get("conditions"):  # the controller's Suspended condition
            w.stop()
    assert seen[0] == "ADDED" and seen[-1] == "MODIFIED"


def test_pod_spec_is_mostly_immutable(kube: FakeKube, api: Any) -> None:
    """Pod updates may only change images, activeDeadlineSeconds and add tolerations: anything
    else in spec (e.g. nodeName) is 422 Invalid; metadata (labels) is free."""
    core = _api(client.CoreV1Api, api)
    core.create_namespaced_pod(NS, pod_body("p"))
    with pytest.raises(ApiException) as e:
        core.patch_namespaced_pod("p", NS, {"spec": {"nodeName": "elsewhere"}})
    s = status_of(e.value)
    assert (e.value.status, s["reason"]) == (422, "Invalid")
    assert s["message"].startswith(
        'Pod "p" is invalid: spec: Forbidden: pod updates may not change'
    )
    patched = core.patch_namespaced_pod(
        "p", NS, {"spec": {"containers": [{"name": "main", "image": "trainer:2"}]}}
    )
    assert patched.spec.containers[0].image == "trainer:2"


def test_watch_selector_transitions(kube: FakeKube, api: Any) -> None:
    """A watch with a selector sees an object that stops matching as DELETED and one that
    starts matching as ADDED (the API server's watch filtering)."""
    kube.add_node("n1")
    kube.add_node("n2")
    core = _api(client.CoreV1Api, api)
    rv = core.list_node().metadata.resource_version

    def writer() -> None:
        time.sleep(0.1)
        core.patch_node("n1", {"metadata": {"labels": {"pool": "gpu"}}})
        core.patch_node("n2", {"metadata": {"labels": {"other": "x"}}})
        core.patch_node("n1", {"metadata": {"labels": {"pool": "spare"}}})

    t = threading.Thread(target=writer)
    t.start()
    w = new_watch()
    events = []
    for e in w.stream(
        core.list_node, label_selector="pool=gpu", resource_version=rv, timeout_seconds=5
    ):
        events.append((e["type"], e["object"].metadata.name))
        if e["type"] == "DELETED":
            w.stop()
    t.join()
    assert events == [("ADDED", "n1"), ("DELETED", "n1")]


def test_watch_from_compacted_resource_version_is_410(kube: FakeKube, api: Any) -> None:
    """A watch from a resourceVersion older than the compaction point gets an ERROR event with
    a 410 Expired Status ("too old resource version"), which Watch.stream raises as
    ApiException(410); without timeout_seconds it first retries once from the same version."""
    core = _api(client.CoreV1Api, api)
    kube.create(pod_body("a"))
    old = core.list_namespaced_pod(NS).metadata.resource_version
    kube.create(pod_body("b"))
    kube.compact()
    with pytest.raises(ApiException) as e:
        for _ in new_watch().stream(
            core.list_namespaced_pod, NS, resource_version=old, timeout_seconds=1
        ):
            pass
    assert e.value.status == 410 and "too old resource version" in e.value.reason
    before = len(kube.requests)
    with pytest.raises(ApiException) as e:
        for _ in new_watch().stream(core.list_namespaced_pod, NS, resource_version=old):
            pass
    assert e.value.status == 410 and len(kube.requests) - before == 2


def test_open_watch_survives_compaction(kube: FakeKube, api: Any) -> None:
    """Compaction does not break a watch that is already open (it is fed from the watch cache)."""
    core = _api(client.CoreV1Api, api)
    rv = core.list_namespaced_pod(NS).metadata.resource_version

    def writer() -> None:
        time.sleep(0.1)
        kube.compact()
        core.create_namespaced_pod(NS, pod_body("p"))

    t = threading.Thread(target=writer)
    t.start()
    w = new_watch()
    events = []
    for e in w.stream(core.list_namespaced_pod, NS, resource_version=rv, timeout_seconds=5):
        events.append(e["type"])
        w.stop()
    t.join()
    assert events[0] == "ADDED"  # (then MODIFIED: PodScheduled=False, there are no nodes)


# --- deletion ---------------------------------------------------------------------------------


def test_graceful_and_force_deletion(kube: FakeKube, api: Any) -> None:
    """Deleting a scheduled pod sets deletionTimestamp and deletionGracePeriodSeconds (from the
    request, else spec.terminationGracePeriodSeconds); it disappears once its kubelet has
    stopped it; gracePeriodSeconds=0 removes it at once; an unscheduled pod goes at once."""
    kube.add_node("n1")
    kube.create(pod_body("p", grace=20))
    kube.create(pod_body("q"))
    kube.wait_for(lambda: len(running_pods(kube)) == 2)
    core = _api(client.CoreV1Api, api)
    pod = core.delete_namespaced_pod("p", NS)
    assert (
        pod.metadata.deletion_timestamp is not None
        and pod.metadata.deletion_grace_period_seconds == 20
    )
    assert core.read_namespaced_pod("p", NS).metadata.deletion_timestamp is not None
    kube.wait_for(lambda: kube.get("Pod", "p") is None)
    gone = core.delete_namespaced_pod("q", NS, grace_period_seconds=0)
    assert gone.metadata.name == "q" and kube.get("Pod", "q") is None


def test_delete_options_body_wins_over_query(kube: FakeKube, api: Any) -> None:
    """The API server reads DeleteOptions from the body when there is one, ignoring the query:
    grace_period_seconds=0 together with body=V1DeleteOptions() is a graceful delete."""
    kube.add_node("n1")
    kube.create(pod_body("p"))
    kube.wait_for(lambda: running_pods(kube))
    core = _api(client.CoreV1Api, api)
    pod = core.delete_namespaced_pod("p", NS, grace_period_seconds=0, body=client.V1DeleteOptions())
    assert pod.metadata.deletion_grace_period_seconds == 30
    core.delete_namespaced_pod("p", NS, body=client.V1DeleteOptions(grace_period_seconds=0))
    assert kube.get("Pod", "p") is None


def test_stuck_terminating_pod_stays_until_force_deleted(kube: FakeKube, api: Any) -> None:
    """A pod whose kubelet never confirms termination (e.g. its node is down) stays terminating
    past its grace period; a delete with gracePeriodSeconds=0 removes it."""
    kube.add_node("n1")
    kube.create(pod_body("p", grace=1))
    kube.wait_for(lambda: running_pods(kube))
    kube.stick_pod("p")
    core = _api(client.CoreV1Api, api)
    core.delete_namespaced_pod("p", NS)
    time.sleep(0.3)  # 30 x the scaled grace period
    assert core.read_namespaced_pod("p", NS).metadata.deletion_timestamp is not None
    core.delete_namespaced_pod("p", NS, grace_period_seconds=0)
    with pytest.raises(ApiException) as e:
        core.read_namespaced_pod("p", NS)
    assert e.value.status == 404


def test_finalizer_keeps_object_even_on_force_delete(kube: FakeKube, api: Any) -> None:
    """An object with finalizers is only marked (deletionTimestamp), even with grace 0; it goes
    when the last finalizer is removed; no finalizer can be added while it is deleting (422)."""
    kube.add_node("n1")
    body = pod_body("p")
    body["metadata"]["finalizers"] = ["example.com/hold"]
    kube.create(body)
    kube.wait_for(lambda: running_pods(kube))
    core = _api(client.CoreV1Api, api)
    core.delete_namespaced_pod("p", NS, grace_period_seconds=0)
    pod = core.read_namespaced_pod("p", NS)
    assert pod.metadata.deletion_timestamp is not None and pod.metadata.finalizers == [
        "example.com/hold"
    ]
    with pytest.raises(ApiException) as e:
        core.patch_namespaced_pod(
            "p", NS, {"metadata": {"finalizers": ["example.com/hold", "x/y"]}}
        )
    assert e.value.status == 422
    core.patch_namespaced_pod("p", NS, [{"op": "remove", "path": "/metadata/finalizers"}])
    kube.wait_for(lambda: kube.get("Pod", "p") is None)


def test_job_deletion_propagation(kube: FakeKube, api: Any) -> None:
    """Deleting a batch/v1 Job without propagationPolicy orphans its pods (the legacy default
    for batch/v1); Background deletes them after the job; Foreground keeps the job (with the
    foregroundDeletion finalizer) until its pods are gone."""
    kube.add_node("n1")
    batch = _api(client.BatchV1Api, api)

    def job(name: str) -> dict[str, Any]:
        tmpl = {
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 5,
                "containers": [{"name": "m", "image": "i"}],
            }
        }
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name},
            "spec": {"template": tmpl},
        }

    for name in ("orphan", "background", "foreground"):
        batch.create_namespaced_job(NS, job(name))
    kube.wait_for(lambda: len(running_pods(kube)) == 3)
    batch.delete_namespaced_job("orphan", NS)
    kube.wait_for(lambda: kube.get("Job", "orphan") is None)
    orphaned = running_pods(kube, "job-name=orphan")
    assert len(orphaned) == 1 and not orphaned[0]["metadata"].get("ownerReferences")

    batch.delete_namespaced_job("background", NS, propagation_policy="Background")
    assert kube.get("Job", "background") is None
    kube.wait_for(lambda: not kube.objects("Pod", NS, "job-name=background"))

    batch.delete_namespaced_job("foreground", NS, propagation_policy="Foreground")
    held = batch.read_namespaced_job("foreground", NS)
    assert (
        held.metadata.finalizers == ["foregroundDeletion"]
        and held.metadata.deletion_timestamp is not None
    )
    kube.wait_for(lambda: kube.get("Job", "foreground") is None)
    assert not kube.objects("Pod", NS, "job-name=foreground")


# --- eviction ----------------------------------------------------------------------------------


def test_eviction_marks_disruption_target_and_deletes_gracefully(kube: FakeKube, api: Any) -> None:
    """POST pods/{name}/eviction answers 201 with a Success Status, adds the condition
    DisruptionTarget (reason EvictionByEvictionAPI) and starts a graceful deletion."""
    kube.add_node("n1")
    kube.create(pod_body("p", grace=10))
    kube.wait_for(lambda: running_pods(kube))
    core = _api(client.CoreV1Api, api)
    eviction = client.V1Eviction(metadata=client.V1ObjectMeta(name="p", namespace=NS))
    core.create_namespaced_pod_eviction("p", NS, eviction)
    assert kube.requests[-1].status == 201
    pod = core.read_namespaced_pod("p", NS)
    target = [c for c in pod.status.conditions if c.type == "DisruptionTarget"]
    assert target and target[0].status == "True" and target[0].reason == "EvictionByEvictionAPI"
    assert pod.metadata.deletion_grace_period_seconds == 10
    kube.wait_for(lambda: kube.get("Pod", "p") is None)
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod_eviction("p", NS, eviction)
    assert e.value.status == 404


# --- scheduling, taints, nodes ----------------------------------------------------------------


def test_scheduler_capacity_cordon_and_unschedulable_message(kube: FakeKube, api: Any) -> None:
    """Pods go onto Ready, schedulable nodes with room (nvidia.com/gpu, pods); without room
    they stay Pending with PodScheduled=False, reason Unschedulable; cordoned nodes take none."""
    kube.add_node("n1", gpus=8)
    kube.add_node("n2", gpus=8, unschedulable=True)
    kube.add_node("n3")  # no GPUs
    kube.create(pod_body("a", gpus=8))
    kube.create(pod_body("b", gpus=8))
    kube.wait_for(lambda: running_pods(kube))
    core = _api(client.CoreV1Api, api)
    a = core.read_namespaced_pod("a", NS)
    assert a.spec.node_name == "n1" and a.status.phase == "Running"

    def unschedulable() -> Any:
        pod = core.read_namespaced_pod("b", NS)
        return [
            c
            for c in pod.status.conditions or []
            if c.type == "PodScheduled" and c.reason == "Unschedulable"
        ]

    cond = kube.wait_for(unschedulable)[0]
    assert cond.status == "False"
    assert cond.message == (
        "0/3 nodes are available: 2 Insufficient nvidia.com/gpu, 1 node(s) were unschedulable."
    )
    assert core.read_namespaced_pod("b", NS).status.phase == "Pending"
    core.patch_node("n2", {"spec": {"unschedulable": False}})
    kube.wait_for(lambda: len(running_pods(kube)) == 2)
    assert core.read_namespaced_pod("b", NS).spec.node_name == "n2"


def test_noexecute_taint_evicts_non_tolerating_pods(kube: FakeKube, api: Any) -> None:
    """A NoExecute taint makes the taint-eviction controller delete the pods on that node that
    do not tolerate it, after marking them DisruptionTarget (reason DeletionByTaintManager)."""
    kube.add_node("n1")
    tol = [{"key": "supervisor/unhealthy", "operator": "Exists", "effect": "NoExecute"}]
    kube.create(pod_body("plain", grace=60))
    kube.create(pod_body("tolerant", tolerations=tol))
    kube.wait_for(lambda: len(running_pods(kube)) == 2)
    core = _api(client.CoreV1Api, api)
    core.patch_node(
        "n1",
        {
            "spec": {
                "taints": [{"key": "supervisor/unhealthy", "value": "xid", "effect": "NoExecute"}]
            }
        },
    )

    def evicted() -> Any:
        pod = core.read_namespaced_pod("plain", NS)
        return pod.metadata.deletion_timestamp and pod

    pod = kube.wait_for(evicted)
    target = next(c for c in pod.status.conditions if c.type == "DisruptionTarget")
    assert target.reason == "DeletionByTaintManager"
    kube.wait_for(lambda: kube.get("Pod", "plain") is None)
    assert core.read_namespaced_pod("tolerant", NS).metadata.deletion_timestamp is None


def test_node_not_ready_taints_node_and_unreadies_pods(kube: FakeKube, api: Any) -> None:
    """A node whose Ready condition turns False gets the node.kubernetes.io/not-ready taints and
    its pods' Ready condition turns False; both are undone when it is Ready again."""
    kube.add_node("n1")
    kube.create(pod_body("p"))
    kube.wait_for(lambda: running_pods(kube))
    core = _api(client.CoreV1Api, api)
    kube.set_node_ready("n1", False)

    def state() -> tuple[set[str], str]:
        node = core.read_node("n1")
        pod = core.read_namespaced_pod("p", NS)
        ready = next(c.status for c in pod.status.conditions if c.type == "Ready")
        return {f"{t.key}:{t.effect}" for t in node.spec.taints or []}, ready

    kube.wait_for(
        lambda: (
            state()
            == (
                {
                    "node.kubernetes.io/not-ready:NoSchedule",
                    "node.kubernetes.io/not-ready:NoExecute",
                },
                "False",
            )
        )
    )
    kube.set_node_ready("n1", True)
    kube.wait_for(lambda: state() == (set(), "True"))


# --- JobSet controller -------------------------------------------------------------------------


def _nodes(kube: FakeKube, n: int) -> None:
    for i in range(n):
        kube.add_node(f"gpu-{i}", gpus=8)


def test_jobset_creates_jobs_and_pods_with_labels(kube: FakeKube, api: Any) -> None:
    """The JobSet controller creates <jobset>-<replicatedJob>-<index> Jobs owned by the JobSet,
    the job controller <job>-<index>-<rand> pods; both carry the JobSet labels; pods are
    scheduled one per 8-GPU node and run."""
    _nodes(kube, 4)
    co = _api(client.CustomObjectsApi, api)
    co.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, jobset_body("train"))
    kube.wait_for(lambda: len(jobset_pods(kube, "train", 0)) == 4)
    jobs = (
        _api(client.BatchV1Api, api)
        .list_namespaced_job(NS, label_selector=f"{JS_LABEL}jobset-name=train")
        .items
    )
    assert sorted(j.metadata.name for j in jobs) == ["train-workers-0", "train-workers-1"]
    js_uid = co.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "train")["metadata"]["uid"]
    for j in jobs:
        assert (
            j.metadata.owner_references[0].uid == js_uid
            and j.metadata.owner_references[0].kind == "JobSet"
        )
    pods = (
        _api(client.CoreV1Api, api)
        .list_namespaced_pod(NS, label_selector=f"{JS_LABEL}jobset-name=train")
        .items
    )
    assert len({p.spec.node_name for p in pods}) == 4
    for p in pods:
        labels = p.metadata.labels
        job_index = labels[JS_LABEL + "job-index"]
        assert labels[JS_LABEL + "replicatedjob-name"] == "workers"
        assert labels[JS_LABEL + "job-global-index"] == job_index
        assert labels[JS_LABEL + "restart-attempt"] == "0"
        index = labels["batch.kubernetes.io/job-completion-index"]
        assert p.metadata.name.startswith(f"train-workers-{job_index}-{index}-")
        assert p.spec.subdomain == "train"


def test_deleting_a_child_job_recreates_it(kube: FakeKube, api: Any) -> None:
    """A child Job deleted from outside is recreated by the JobSet controller (new uid, same
    restart-attempt), with new pods."""
    _nodes(kube, 4)
    _api(client.CustomObjectsApi, api).create_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, jobset_body("train")
    )
    kube.wait_for(lambda: len(jobset_pods(kube, "train", 0)) == 4)
    batch = _api(client.BatchV1Api, api)
    old = batch.read_namespaced_job("train-workers-1", NS)
    old_pods = {p["metadata"]["uid"] for p in kube.objects("Pod", NS, "job-name=train-workers-1")}
    batch.delete_namespaced_job("train-workers-1", NS, propagation_policy="Foreground")

    def recreated() -> Any:
        job = kube.get("Job", "train-workers-1")
        return job and job["metadata"]["uid"] != old.metadata.uid

    kube.wait_for(recreated)
    kube.wait_for(lambda: len(jobset_pods(kube, "train", 0)) == 4)
    new_pods = {p["metadata"]["uid"] for p in kube.objects("Pod", NS, "job-name=train-workers-1")}
    assert new_pods and not new_pods & old_pods


def test_foreground_deletion_of_a_jobset_removes_the_tree_owner_last(
    kube: FakeKube, api: Any
) -> None:
    """Deleting a JobSet with propagationPolicy Foreground: it stays (deletionTimestamp,
    foregroundDeletion finalizer) while the garbage collector deletes its Jobs, which in
    turn wait for their pods (the GC deletes dependents that have dependents of their own
    in the foreground too); the JobSet goes last, so the name can be created again only
    once no old pod is left. The scaling action of the backend relies on this order."""
    _nodes(kube, 4)
    co = _api(client.CustomObjectsApi, api)
    # Pods that take 1 s to stop (100 s scaled): the checks below fit in it, even on a
    # loaded machine.
    body = jobset_body("train", grace=100)
    co.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body)
    kube.wait_for(lambda: len(jobset_pods(kube, "train", 0)) == 4)
    co.delete_namespaced_custom_object(
        GROUP,
        VERSION,
        NS,
        PLURAL,
        "train",
        body=client.V1DeleteOptions(propagation_policy="Foreground"),
    )
    held = kube.get("JobSet", "train")
    assert held is not None and held["metadata"]["deletionTimestamp"]
    assert "foregroundDeletion" in held["metadata"]["finalizers"]
    with pytest.raises(ApiException) as e:
        co.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, jobset_body("train"))
    assert e.value.status == 409 and status_of(e.value)["reason"] == "AlreadyExists"
    kube.wait_for(lambda: kube.get("JobSet", "train") is None)
    assert not kube.objects("Job", NS) and not kube.objects(
        "Pod", NS, f"{JS_LABEL}jobset-name=train"
    )


def test_evicting_a_pod_restarts_the_jobset(kube: FakeKube, api: Any) -> None:
    """An evicted pod fails its Job (backoffLimit 0), and the JobSet failure policy restarts
    every Job: status.restarts and the restart-attempt label go to 1."""
    _nodes(kube, 4)
    co = _api(client.CustomObjectsApi, api)
    co.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, jobset_body("train"))
    kube.wait_for(lambda: len(jobset_pods(kube, "train", 0)) == 4)
    victim = jobset_pods(kube, "train", 0)[0]["metadata"]["name"]
    _api(client.CoreV1Api, api).create_namespaced_pod_eviction(
        victim, NS, {"metadata": {"name": victim}}
    )
    kube.wait_for(lambda: len(jobset_pods(kube, "train", 1)) == 4, timeout=10)
    js = co.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "train")
    assert js["status"]["restarts"] == 1 and js["status"]["restartsCountTowardsMax"] == 1
    jobs = _api(client.BatchV1Api, api).list_namespaced_job(NS).items
    assert {j.metadata.labels[JS_LABEL + "restart-attempt"] for j in jobs} == {"1"}
    assert kube.objects("Pod", NS, f"{JS_LABEL}restart-attempt=0") == []


def test_max_restarts_exceeded_fails_the_jobset(kube: FakeKube, api: Any) -> None:
    """Once restartsCountTowardsMax reaches failurePolicy.maxRestarts, the next Job failure marks
    the JobSet Failed (reason ReachedMaxRestarts, terminalState Failed); nothing is restarted
    (the failed Job stays, with its failed pod)."""
    _nodes(kube, 2)
    co = _api(client.CustomObjectsApi, api)
    co.create_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, jobset_body("train", replicas=1, max_restarts=1)
    )
    for attempt in range(2):
        pods = kube.wait_for(functools.partial(jobset_pods_when, kube, "train", attempt, 2))
        kube.fail_pod(pods[0]["metadata"]["name"], exit_code=42)

    def failed() -> Any:
        conds = (
            co.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "train")
            .get("status", {})
            .get("conditions", [])
        )
        return [c for c in conds if c["type"] == "Failed" and c["status"] == "True"]

    cond = kube.wait_for(failed)[0]
    assert cond["reason"] == "ReachedMaxRestarts"
    assert cond["message"].startswith("jobset failed due to reaching max number of restarts")
    js = co.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "train")
    assert js["status"]["terminalState"] == "Failed" and js["status"]["restarts"] == 1
    kube.wait_for(lambda: not running_pods(kube))
    time.sleep(0.2)
    assert [
        j["metadata"]["labels"][JS_LABEL + "restart-attempt"] for j in kube.objects("Job", NS)
    ] == ["1"]


def test_jobset_without_failure_policy_fails_on_first_job_failure(kube: FakeKube, api: Any) -> None:
    """With no failurePolicy a failed child Job fails the JobSet (reason FailedJobs)."""
    _nodes(kube, 2)
    co = _api(client.CustomObjectsApi, api)
    co.create_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, jobset_body("js", replicas=1, max_restarts=None)
    )
    pods = kube.wait_for(lambda: jobset_pods_when(kube, "js", 0, 2))
    kube.fail_pod(pods[0]["metadata"]["name"])
    kube.wait_for(
        lambda: (
            co.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "js")
            .get("status", {})
            .get("terminalState")
            == "Failed"
        )
    )


def test_suspend_and_resume(kube: FakeKube, api: Any) -> None:
    """spec.suspend=true suspends the child Jobs (their pods are deleted, not counted as failures,
    condition Suspended); false resumes them (new pods, same restart attempt)."""
    _nodes(kube, 4)
    co = _api(client.CustomObjectsApi, api)
    co.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, jobset_body("train"))
    kube.wait_for(lambda: len(jobset_pods(kube, "train", 0)) == 4)
    co.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "train", {"spec": {"suspend": True}}
    )
    kube.wait_for(lambda: not kube.objects("Pod", NS))
    js = co.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "train")
    assert [
        (c["status"], c["reason"]) for c in js["status"]["conditions"] if c["type"] == "Suspended"
    ] == [("True", "SuspendedJobs")]
    assert all(j.spec.suspend for j in _api(client.BatchV1Api, api).list_namespaced_job(NS).items)
    co.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "train", {"spec": {"suspend": False}}
    )
    kube.wait_for(lambda: len(jobset_pods(kube, "train", 0)) == 4)
    js = co.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "train")
    assert js["status"]["restarts"] == 0
    assert [c["reason"] for c in js["status"]["conditions"] if c["type"] == "Suspended"] == [
        "ResumeJobs"
    ]


def test_jobset_completes_when_all_jobs_complete(kube: FakeKube, api: Any) -> None:
    """Pods that succeed complete their Indexed Job (Complete once every index succeeded), and
    the default success policy (All) marks the JobSet Completed (reason AllJobsCompleted)."""
    _nodes(kube, 2)
    co = _api(client.CustomObjectsApi, api)
    co.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, jobset_body("js", replicas=1))
    for pod in kube.wait_for(lambda: jobset_pods_when(kube, "js", 0, 2)):
        kube.succeed_pod(pod["metadata"]["name"])

    def completed() -> Any:
        js = co.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "js")
        return [c for c in js.get("status", {}).get("conditions", []) if c["type"] == "Completed"]

    assert kube.wait_for(completed)[0]["reason"] == "AllJobsCompleted"
    job = _api(client.BatchV1Api, api).read_namespaced_job("js-workers-0", NS)
    assert job.status.succeeded == 2
    assert [c.type for c in job.status.conditions if c.status == "True"] == [
        "SuccessCriteriaMet",
        "Complete",
    ]


def test_pod_failure_policy_fails_job_on_disruption_target(kube: FakeKube, api: Any) -> None:
    """A Job with podFailurePolicy FailJob on DisruptionTarget: an evicted pod is counted once it
    is terminal (podReplacementPolicy Failed), the Job gets FailureTarget with reason
    PodFailurePolicy, then Failed when no pod is left running."""
    kube.add_node("n1")
    tmpl = {
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            "containers": [{"name": "m", "image": "i"}],
        }
    }
    job = {
        "metadata": {"name": "j"},
        "spec": {
            "backoffLimit": 6,
            "template": tmpl,
            "podFailurePolicy": {
                "rules": [{"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget"}]}]
            },
        },
    }
    batch = _api(client.BatchV1Api, api)
    created = batch.create_namespaced_job(NS, job)
    assert created.spec.pod_replacement_policy == "Failed"
    pod = kube.wait_for(lambda: running_pods(kube, "job-name=j"))[0]["metadata"]["name"]
    _api(client.CoreV1Api, api).create_namespaced_pod_eviction(pod, NS, {"metadata": {"name": pod}})

    def failed() -> Any:
        conds = batch.read_namespaced_job("j", NS).status.conditions or []
        return [c for c in conds if c.type == "Failed" and c.status == "True"]

    cond = kube.wait_for(failed)[0]
    assert cond.reason == "PodFailurePolicy"
    assert "has condition DisruptionTarget matching FailJob rule at index 0" in cond.message
    left = kube.get("Pod", pod)
    assert left is None or left["status"]["phase"] == "Failed"


def test_jobset_replicas_and_failure_policy_are_immutable(kube: FakeKube, api: Any) -> None:
    """replicatedJobs (hence replicas) is immutable through the JobSet validating webhook: a
    plain error that controller-runtime answers as 403 Forbidden ("admission webhook
    \\"vjobset.kb.io\\" denied the request: spec.replicatedJobs: ... field is immutable");
    failurePolicy is immutable through a CRD CEL rule: 422 Invalid "Value is immutable"."""
    co = _api(client.CustomObjectsApi, api)
    co.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, jobset_body("js", suspend=True))
    rjobs = co.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "js")["spec"][
        "replicatedJobs"
    ]
    rjobs[0]["replicas"] = 1
    with pytest.raises(ApiException) as e:
        co.patch_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL, "js", {"spec": {"replicatedJobs": rjobs}}
        )
    s = status_of(e.value)
    assert (e.value.status, s["reason"]) == (403, "Forbidden")
    assert s["message"].startswith(
        'admission webhook "vjobset.kb.io" denied the request: spec.replicatedJobs'
    )
    assert s["message"].endswith("field is immutable")
    with pytest.raises(ApiException) as e:
        co.patch_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL, "js", {"spec": {"failurePolicy": {"maxRestarts": 9}}}
        )
    s = status_of(e.value)
    assert (e.value.status, s["reason"]) == (422, "Invalid") and "Value is immutable" in s[
        "message"
    ]


# --- leases, events ----------------------------------------------------------------------------


def test_lease_race_only_one_writer_wins(kube: FakeKube) -> None:
    """Two clients racing on the same Lease: one create wins, the other gets 409 AlreadyExists;
    both read it and try to take it over: exactly one replace succeeds, the other is 409."""
    barrier = threading.Barrier(2)
    results: dict[str, list[int]] = {"create": [], "replace": []}
    lock = threading.Lock()

    def contender(identity: str) -> None:
        with kube.client() as c:
            coord = _api(client.CoordinationV1Api, c)
            lease = {
                "metadata": {"name": "leader"},
                "spec": {
                    "holderIdentity": identity,
                    "leaseDurationSeconds": 15,
                    "leaseTransitions": 0,
                },
            }
            barrier.wait()
            try:
                coord.create_namespaced_lease(NS, lease)
                code = 201
            except ApiException as e:
                code = e.status
            with lock:
                results["create"].append(code)
            barrier.wait()
            current = coord.read_namespaced_lease("leader", NS)
            barrier.wait()
            current.spec.holder_identity = identity
            current.spec.lease_transitions = (current.spec.lease_transitions or 0) + 1
            try:
                coord.replace_namespaced_lease("leader", NS, current)
                code = 200
            except ApiException as e:
                code = e.status
            with lock:
                results["replace"].append(code)

    threads = [threading.Thread(target=contender, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results["create"]) == [201, 409]
    assert sorted(results["replace"]) == [200, 409]
    lease = kube.get("Lease", "leader")
    assert lease is not None and lease["spec"]["leaseTransitions"] == 1


def test_events_create_patch_list(kube: FakeKube, api: Any) -> None:
    """core/v1 Events: create, patch (count/lastTimestamp), list by involvedObject field."""
    core = _api(client.CoreV1Api, api)
    event = client.CoreV1Event(
        metadata=client.V1ObjectMeta(generate_name="gpu-0."),
        involved_object=client.V1ObjectReference(kind="Node", name="gpu-0", api_version="v1"),
        reason="HotSwap",
        message="cordoned after XID 79",
        type="Warning",
        count=1,
        source=client.V1EventSource(component="resiliency-supervisor"),
    )
    created = core.create_namespaced_event(NS, event)
    patched = core.patch_namespaced_event(created.metadata.name, NS, {"count": 2})
    assert patched.count == 2 and patched.reason == "HotSwap"
    found = core.list_namespaced_event(
        NS,
        field_selector="involvedObject.kind=Node,involvedObject.name=gpu-0,source=resiliency-supervisor",
    )
    assert [e.metadata.name for e in found.items] == [created.metadata.name]


# --- failure injection -------------------------------------------------------------------------


def test_injected_faults(kube: FakeKube, api: Any) -> None:
    """fail_next: 429 with Retry-After and a TooManyRequests Status, 500 InternalError, 504
    Timeout, counted per matching request; apply=True performs the request and loses the
    answer (a retried create then meets 409 AlreadyExists); a slow answer is a client-side
    read timeout. Also pins what urllib3 under the client does by itself: GETs answered
    429 with Retry-After, and GET read timeouts, are retried; POSTs are not."""
    core = _api(client.CoreV1Api, api)
    fault = kube.fail_next("create", r"/pods$", 429, times=2)
    for _ in range(2):
        with pytest.raises(ApiException) as e:
            core.create_namespaced_pod(NS, pod_body("p"))
        assert e.value.status == 429 and (e.value.headers or {})["Retry-After"] == "1"
        assert status_of(e.value)["reason"] == "TooManyRequests"
    assert fault.hits == 2 and kube.get("Pod", "p") is None

    # urllib3 (Retry.DEFAULT) itself retries a GET answered 429/503 with Retry-After,
    # after sleeping that long: the caller never sees the first 429.
    fault = kube.fail_next("list", r"/pods$", 429)
    started = time.monotonic()
    assert core.list_namespaced_pod(NS).items == []
    assert fault.hits == 1 and time.monotonic() - started >= 1.0

    kube.fail_next("patch", r"/nodes/", 500)
    kube.add_node("n1")
    with pytest.raises(ApiException) as e:
        core.patch_node("n1", {"metadata": {"labels": {"a": "b"}}})
    assert e.value.status == 500 and status_of(e.value)["reason"] == "InternalError"
    assert "a" not in (core.read_node("n1").metadata.labels or {})

    kube.fail_next("create", r"/pods$", 504, apply=True)
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod(NS, pod_body("p"))
    assert status_of(e.value)["reason"] == "Timeout"
    assert e.value.status == 504
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod(NS, pod_body("p"))
    assert e.value.status == 409

    coord = _api(client.CoordinationV1Api, api)
    slow = kube.fail_next("create", r"/leases$", None, delay=0.5)
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        coord.create_namespaced_lease(NS, {"metadata": {"name": "l"}}, _request_timeout=0.1)
    assert slow.hits == 1  # a POST is not retried by urllib3
    slow = kube.fail_next("list", r"/leases$", None, delay=0.3, times=10)
    with pytest.raises(urllib3.exceptions.MaxRetryError):
        coord.list_namespaced_lease(NS, _request_timeout=0.05)
    assert slow.hits == 4  # a GET read timeout is retried 3 times by urllib3 (Retry.DEFAULT)

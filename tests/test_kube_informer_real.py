"""The informer (supervisor/kube/informer.py) against the real API server: when its watch
expires (etcd compacted past the version the informer would resume from, its next watch
answered 410 Gone as the real server words it, a new list, and nothing missed), and while
its watch is quiet (the server's bookmarks carry it forward, so it resumes without
listing again).

The API server of tests/control_plane.py serves ConfigMaps' watches from etcd itself
(`--watch-cache-sizes=configmaps#0`), so compacting etcd expires them at once, as a watch
cache's window running out does on a busy cluster. Secrets are served from the watch cache,
as the backend's Pods, Jobs, Nodes and JobSets are: the cache is what sends bookmarks. The
informer is the same for every kind; the backend's differ only in their list call.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from kubernetes import client, config

from supervisor.kube.informer import Informer
from supervisor.kube.objects import Obj
from tests.control_plane import ControlPlane
from tests.kube_real import NS
from tests.timing import scaled


def configmap(name: str, label: str, kind: str = "ConfigMap") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": kind,
        "metadata": {"name": name, "namespace": NS, "labels": {"informer-test": label}},
    }


def compact(plane: ControlPlane) -> int:
    """Compact etcd at its current revision (its JSON gateway); the revision."""
    key = base64.b64encode(b"/").decode()
    now = httpx.post(f"{plane.etcd_url}/v3/kv/range", json={"key": key}, timeout=10)
    now.raise_for_status()
    revision = int(now.json()["header"]["revision"])
    done = httpx.post(
        f"{plane.etcd_url}/v3/kv/compaction",
        json={"revision": str(revision), "physical": True},
        timeout=30,
    )
    done.raise_for_status()
    return revision


@asynccontextmanager
async def informing(
    plane: ControlPlane, label: str, kind: str = "ConfigMap", watch_timeout_s: int = 1
) -> AsyncIterator[tuple[Informer, list[str]]]:
    """An informer of the ConfigMaps (or Secrets) labelled `label`, as the admin, reopening
    its watch every `watch_timeout_s`; and the changes it told, as "TYPE name" lines."""
    api = config.new_client_from_config(config_file=str(plane.admin.kubeconfig))
    core = client.CoreV1Api(api)
    lister = core.list_namespaced_secret if kind == "Secret" else core.list_namespaced_config_map
    informer = Informer(
        kind,
        functools.partial(lister, NS),
        asyncio.get_running_loop(),
        label_selector=f"informer-test={label}",
        watch_timeout_s=watch_timeout_s,
        backoff_s=(0.05, 0.5),
        request_timeout_s=10.0,
    )
    told: list[str] = []

    def heard(kind: str, obj: Obj, _before: Obj | None) -> None:
        told.append(f"{kind} {obj['metadata']['name']}")

    informer.listeners.append(heard)
    informer.start()
    try:
        await asyncio.wait_for(informer.synced.wait(), scaled(30))
        yield informer, told
    finally:
        await informer.stop()
        api.close()


async def until(
    predicate: Callable[[], Any], what: str, informer: Informer, within: float = 30.0
) -> None:
    deadline = asyncio.get_running_loop().time() + scaled(within)
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, (
            f"timed out: {what}; the informer's counts {informer.stats}, its last error "
            f"{informer.last_error!r}, at resourceVersion {informer.resource_version}"
        )
        await asyncio.sleep(0.05)


async def test_a_watch_expired_by_a_compaction_lists_again_and_misses_nothing(
    control_plane: ControlPlane,
) -> None:
    label = uuid.uuid4().hex[:8]
    path = f"/api/v1/namespaces/{NS}/configmaps"
    with control_plane.client() as api:
        assert api.post(path, json=configmap(f"kept-{label}", label)).status_code == 201
        async with informing(control_plane, label) as (informer, told):
            assert set(informer.items) == {f"{NS}/kept-{label}"}
            lists = informer.stats["lists"]
            # The cluster moves on without a change the informer watches (no bookmark
            # either: etcd's own watch sends none), then etcd forgets the history.
            for i in range(5):
                other = configmap(f"other-{label}-{i}", f"not-{label}")
                assert api.post(path, json=other).status_code == 201
            compact(control_plane)
            # Its watch, reopened every second from the version of its last change, is
            # refused with 410 Gone, and it lists again.
            await until(lambda: informer.stats["gone"] >= 1, "a watch expired (410)", informer)
            await until(lambda: informer.stats["lists"] > lists, "a new list", informer)
            # Changes after the new list: each told once, none lost to the expiry.
            r = api.delete(f"{path}/kept-{label}")
            assert r.status_code == 200, r.text
            assert api.post(path, json=configmap(f"new-{label}", label)).status_code == 201
            await until(
                lambda: set(informer.items) == {f"{NS}/new-{label}"}, "the new state", informer
            )
            await until(lambda: f"ADDED new-{label}" in told, "the new ConfigMap told", informer)
            assert told.count(f"DELETED kept-{label}") == 1, told
            assert told.count(f"ADDED new-{label}") == 1, told
            assert informer.stats["errors"] == 0, informer.stats


async def reached(predicate: Callable[[], bool], within_s: float) -> bool:
    """Whether `predicate` comes true within `within_s` (polled)."""
    for _ in range(max(1, round(within_s / 0.05))):
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return predicate()


async def test_bookmarks_carry_a_quiet_watch_forward_and_it_resumes_without_listing(
    control_plane: ControlPlane,
) -> None:
    """Nothing the informer watches changes while other Secrets do. The server's BOOKMARK
    events (sent 2 s before each watch's deadline, to a watch registered before then)
    move the informer's resourceVersion past its list's to where the cluster is, and each
    reconnect resumes from there: one list, no 410, no change told but the first.

    The watch cache bookmarks a watch only with a version newer than the newest change it
    held when the watch started (`cacheWatcher.processInterval` in k8s.io/apiserver): a
    change made between two of the informer's watches, or before its first one was
    registered, is carried by no bookmark until the next change. On a loaded machine that
    happened (no bookmark in 6 watches in a row), so the test changes another Secret each
    watch period until a bookmark carries the informer past the first change."""
    label = uuid.uuid4().hex[:8]
    path = f"/api/v1/namespaces/{NS}/secrets"
    with control_plane.client() as api:
        assert api.post(path, json=configmap(f"kept-{label}", label, "Secret")).status_code == 201
        # The server sends a watch's bookmark 2 s before its deadline, to a watch it took
        # in before then: on a starved machine it took in 27 watches of 4 s in a row too
        # late for theirs. The margin scales with the machine.
        watch_timeout_s = round(scaled(5))
        async with informing(control_plane, label, "Secret", watch_timeout_s) as (
            informer,
            told,
        ):
            listed = int(informer.resource_version or 0)
            changes = 0

            def change_another() -> int:
                nonlocal changes
                name = f"other-{label}-{changes}"
                changes += 1
                moved = api.post(path, json=configmap(name, f"not-{label}", "Secret"))
                assert moved.status_code == 201, moved.text
                return int(moved.json()["metadata"]["resourceVersion"])

            def at(version: int) -> bool:
                return int(informer.resource_version or 0) >= version

            loop = asyncio.get_running_loop()
            for _ in range(2):
                now = change_another()
                assert now > listed
                watches = informer.stats["watches"]
                # Only a bookmark carries the version to a change the selector leaves out.
                deadline = loop.time() + scaled(60)
                while not await reached(lambda: at(now), watch_timeout_s + 2):  # noqa: B023
                    if loop.time() > deadline:
                        break
                    change_another()  # made while a watch is open, unlike the last
                await until(lambda: at(now), f"a bookmark at or past {now}", informer, 0)  # noqa: B023
                await until(
                    lambda: informer.stats["watches"] > watches,  # noqa: B023
                    "the watch reopened from the bookmark's version",
                    informer,
                )
            assert informer.stats["lists"] == 1, informer.stats
            assert informer.stats["gone"] == 0 and informer.stats["errors"] == 0, informer.stats
            assert told == [f"ADDED kept-{label}"], told

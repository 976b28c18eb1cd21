"""Discovery: which pods of which JobSet run on which node, which GPU nodes are spares,
and each JobSet's data-parallel replicas and bounds, kept current by watches.

Four informers (list + watch, see `informer.py`): the supervised JobSets
(`kube_jobset_selector`), their child Jobs and pods (JobSet's `jobset-name` label) in
`kube_namespace`, and the GPU nodes (`kube_gpu_node_selector`). Everything here runs on
the event loop and reads the informers' caches; nothing polls the API server.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from kubernetes import client

from supervisor.config_parts import KubernetesSettings, WorkloadSettings
from supervisor.domain import utcnow
from supervisor.kube import objects as o
from supervisor.kube.errors import NotFound
from supervisor.kube.informer import Informer
from supervisor.kube.objects import JobShape, Obj

#: (kind, event type, object, object before) for every change seen by a watch.
ChangeListener = Callable[[str, str, Obj, Obj | None], None]

#: What the operator reads where the API server does not serve JobSets at all.
JOBSET_CRD_MISSING = (
    f"the JobSet CRD {o.JOBSET_PLURAL}.{o.JOBSET_GROUP} is not installed in the cluster "
    f"(the API server has no {o.JOBSET_API_VERSION} {o.JOBSET_PLURAL}): install JobSet "
    "(its CRD and controller); the supervisor lists JobSets again on its own, no restart needed"
)


class Discovery:
    def __init__(
        self,
        api: client.ApiClient,
        settings: KubernetesSettings,
        workload: WorkloadSettings,
        *,
        watch_timeout_s: int = 300,
        request_timeout_s: float = 30.0,
    ) -> None:
        self.settings = settings
        #: A JobSet's shape where its annotations do not say.
        self.workload = workload
        self._api = api
        self._watch_timeout_s = watch_timeout_s
        self._request_timeout_s = request_timeout_s
        self.informers: dict[str, Informer] = {}
        self.listeners: list[ChangeListener] = []
        self._waiters: set[asyncio.Future[None]] = set()
        # Pods by JobSet and by node (cache keys), kept with the pod cache: sensing asks
        # per pod change, which must not cost a scan of every pod.
        self._by_jobset: dict[str, set[str]] = {}
        self._by_node: dict[str, set[str]] = {}
        # When a watch first delivered each pod and Job (by UID), on our clock: their
        # creationTimestamp has second precision, too coarse to order them against an
        # event of the same second. Objects of the first list are not in it.
        self._seen: dict[str, datetime] = {}
        # Each JobSet's status.restarts as it changed: (uid, restarts, when a watch saw
        # it; None when it was so at the first list).
        self._restarts: dict[str, list[tuple[str, int, datetime | None]]] = {}

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        core, batch = client.CoreV1Api(self._api), client.BatchV1Api(self._api)
        custom = client.CustomObjectsApi(self._api)
        ns, s = self.settings.kube_namespace, self.settings
        calls: dict[str, tuple[Callable[..., Any], str]] = {
            "JobSet": (
                functools.partial(
                    custom.list_namespaced_custom_object,
                    o.JOBSET_GROUP,
                    o.JOBSET_VERSION,
                    ns,
                    o.JOBSET_PLURAL,
                ),
                s.kube_jobset_selector,
            ),
            "Job": (functools.partial(batch.list_namespaced_job, ns), o.JOBSET_NAME),
            "Pod": (functools.partial(core.list_namespaced_pod, ns), o.JOBSET_NAME),
            "Node": (core.list_node, s.kube_gpu_node_selector),
        }
        for kind, (call, selector) in calls.items():
            informer = Informer(
                kind,
                call,
                loop,
                label_selector=selector,
                watch_timeout_s=self._watch_timeout_s,
                request_timeout_s=self._request_timeout_s,
            )
            informer.listeners.append(functools.partial(self._changed, kind))
            self.informers[kind] = informer
            informer.start()

    async def stop(self) -> None:
        await asyncio.gather(*(i.stop() for i in self.informers.values()))
        for waiter in self._waiters:
            if not waiter.done():
                waiter.cancel()

    async def synced(self, timeout_s: float) -> bool:
        """Wait until every informer has listed once."""
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*(i.synced.wait() for i in self.informers.values()))
        except TimeoutError:
            return False
        return True

    def jobset_crd_missing(self) -> str | None:
        """Why no JobSet can be listed, when the API server serves no JobSets (the list's
        404: the CRD is not installed, or was removed); None otherwise."""
        informer = self.informers.get("JobSet")
        if informer is not None and isinstance(informer.last_error, NotFound):
            return JOBSET_CRD_MISSING
        return None

    def _changed(self, kind: str, type_: str, obj: Obj, before: Obj | None) -> None:
        if kind == "Pod":
            self._index(type_, obj, before)
        if kind in ("Pod", "Job"):
            if type_ == "DELETED":
                self._seen.pop(o.uid_of(obj), None)
            elif before is None and self.informers[kind].synced.is_set():
                self._seen.setdefault(o.uid_of(obj), utcnow())
        elif kind == "JobSet" and type_ != "DELETED":
            self._note_restarts(obj)
        for listener in self.listeners:
            listener(kind, type_, obj, before)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _index(self, type_: str, pod: Obj, before: Obj | None) -> None:
        key = o.key_of(pod)
        if before is not None:
            self._by_jobset.get(o.jobset_of(before) or "", set()).discard(key)
            self._by_node.get(o.node_of(before) or "", set()).discard(key)
        if type_ != "DELETED":
            self._by_jobset.setdefault(o.jobset_of(pod) or "", set()).add(key)
            self._by_node.setdefault(o.node_of(pod) or "", set()).add(key)

    def _note_restarts(self, js: Obj) -> None:
        history = self._restarts.setdefault(o.name_of(js), [])
        uid, restarts = o.uid_of(js), o.jobset_restarts(js)
        if history and history[-1][:2] == (uid, restarts):
            return
        seen = utcnow() if self.informers["JobSet"].synced.is_set() else None
        history.append((uid, restarts, seen))
        del history[:-20]

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait for `predicate()` to hold, re-checked on every change the watches see."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.add(waiter)
            try:
                await asyncio.wait_for(waiter, left)
            except TimeoutError:
                pass
            finally:
                self._waiters.discard(waiter)
        return True

    # --- reads ---------------------------------------------------------------------------

    def _items(self, kind: str) -> list[Obj]:
        informer = self.informers.get(kind)
        return list(informer.items.values()) if informer else []

    def _item(self, kind: str, key: str) -> Obj | None:
        informer = self.informers.get(kind)
        return informer.items.get(key) if informer else None

    def jobsets(self) -> dict[str, Obj]:
        return {o.name_of(js): js for js in self._items("JobSet")}

    def jobset(self, name: str) -> Obj | None:
        return self.jobsets().get(name)  # a namespace holds few JobSets

    def child_jobs(self, jobset: str) -> list[Obj]:
        return [j for j in self._items("Job") if o.labels_of(j).get(o.JOBSET_NAME) == jobset]

    def _pods(self, keys: set[str] | None) -> list[Obj]:
        informer = self.informers.get("Pod")
        if informer is None or not keys:
            return []
        return [p for k in keys if (p := informer.items.get(k)) is not None]

    def pods_of(self, jobset: str) -> list[Obj]:
        return self._pods(self._by_jobset.get(jobset))

    def pods_on(self, node: str, jobset: str | None = None) -> list[Obj]:
        return [
            p
            for p in self._pods(self._by_node.get(node))
            if (jobset is None or o.jobset_of(p) == jobset) and not o.pod_finished(p)
        ]

    def nodes(self) -> dict[str, Obj]:
        return {o.name_of(n): n for n in self._items("Node")}

    def node(self, name: str) -> Obj | None:
        # Nodes are cluster-scoped: the informer's key is the name. A lookup per call: the
        # partner requests ask once per node, and a dict of every node per lookup made
        # each round N lookups of N (76% of the supervisor's CPU at 2,000 nodes).
        return self._item("Node", name)

    def nodes_of(self, jobset: str) -> list[str]:
        return sorted(
            {
                n
                for p in self.pods_of(jobset)
                if (n := o.node_of(p)) and not o.pod_finished(p) and not o.terminating(p)
            }
        )

    def jobset_on(self, node: str) -> str | None:
        """The supervised JobSet running on a node, if any."""
        supervised = self.jobsets()
        for pod in self.pods_on(node):
            js = o.jobset_of(pod)
            if js in supervised and not o.terminating(pod):
                return js
        return None

    def spares(self) -> list[str]:
        """Schedulable GPU nodes, without our taint, that run no JobSet pod."""
        busy = {o.node_of(p) for p in self._items("Pod") if not o.pod_finished(p)}
        return sorted(
            name
            for name, node in self.nodes().items()
            if name not in busy
            and o.node_schedulable(node)
            and not o.has_taint(node, self.settings.kube_taint_key)
        )

    def created_after(self, obj: Obj, when: datetime) -> bool:
        """Whether a pod or Job was created after `when` (our clock): by its
        creationTimestamp, or, within that timestamp's second, by when the watch first
        delivered it. An object of the first list, in that second, counts as older."""
        created = o.created(obj)
        if created is None:
            return False
        if created > when:
            return True
        if when - created >= timedelta(seconds=1):
            return False
        seen = self._seen.get(o.uid_of(obj))
        return seen is not None and seen > when

    def restarts_at(self, jobset: Obj, when: datetime) -> int | None:
        """The JobSet's `status.restarts` at `when`, as the watch saw it change (None:
        this JobSet, by UID, was first seen after `when`)."""
        uid = o.uid_of(jobset)
        for seen_uid, restarts, seen in reversed(self._restarts.get(o.name_of(jobset), [])):
            if seen_uid == uid and (seen is None or seen <= when):
                return restarts
        return None

    def shape(self, jobset: Obj) -> JobShape:
        s = self.workload
        return o.job_shape(
            jobset,
            min_default=s.min_num_dp_replicas,
            max_default=s.max_num_dp_replicas,
            nodes_default=s.num_nodes_per_dp,
        )

    def shapes(self) -> dict[str, JobShape]:
        return {name: self.shape(js) for name, js in self.jobsets().items()}

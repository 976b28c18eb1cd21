"""The cluster behind the fake API server: a small controller manager, scheduler and kubelets.

One background thread runs, on every change and every ``tick`` seconds, these loops
(each a small, explicit model of its real counterpart; they act only through the
ApiServer, with resourceVersion preconditions, so they race with API clients the way
real controllers do, and a conflict is simply retried on the next pass):

- **garbage collector**: ``orphan`` / ``foregroundDeletion`` finalizers, dependents of
  owners that no longer exist (matched by uid) are deleted in the background.
- **node lifecycle**: a node whose Ready condition is not True gets the
  ``node.kubernetes.io/not-ready`` NoSchedule and NoExecute taints (removed when it is
  Ready again), and its pods are marked not Ready.
- **taint eviction**: pods on a node with a NoExecute taint they do not tolerate are
  deleted after getting ``DisruptionTarget`` (reason DeletionByTaintManager); a
  toleration with ``tolerationSeconds`` delays that (scaled by ``time_scale``).
- **scheduler**: binds Pending pods to the first node, by name, that is Ready,
  schedulable (or tolerated), has no untolerated NoSchedule/NoExecute taint, matches
  nodeSelector and required node affinity, and has room: ``status.allocatable``
  ``pods`` (default 110), extended resources such as ``nvidia.com/gpu`` (absent means
  0) and, when the node declares them, cpu and memory, counting every non-terminal pod
  bound to it, terminating ones included. Otherwise the pod stays Pending with
  ``PodScheduled=False, reason Unschedulable`` and a "0/N nodes are available: ..."
  message. Not modelled: scoring, preemption, pod (anti-)affinity, topology spread.
- **kubelet** (one per Ready node): runs bound Pending pods (phase Running, Ready), and
  finishes a graceful deletion when the grace period (times ``time_scale``) is over:
  phase Failed unless the pod had succeeded, then the final delete with grace 0. A
  kubelet on a NotReady node does nothing, so its terminating pods stay terminating
  until force-deleted (as on a real cluster); ``stuck_pods`` does the same for single
  pods.
- **job controller** (batch/v1 Job): pods ``<job>-<index>-<rand>`` for Indexed jobs
  (``<job>-<rand>`` otherwise) with the job labels and a controller ownerReference;
  failed pods (phase Failed; or terminating, when the job has no podFailurePolicy and
  podReplacementPolicy is TerminatingOrFailed; or deleted before succeeding) count in
  ``status.failed``; podFailurePolicy rules (onPodConditions, onExitCodes; FailJob,
  Ignore, Count); backoffLimit (and the OnFailure restart count); on failure the
  FailureTarget condition, active pods deleted, then Failed once no pod is left
  running; Complete when every index (or ``completions`` pods) succeeded; ``suspend``
  deletes active pods (not counted as failures) and sets the Suspended condition.
  Not modelled: backoff delays between pod recreations, backoffLimitPerIndex,
  successPolicy, activeDeadlineSeconds, ttlSecondsAfterFinished, job-tracking finalizers.
- **JobSet controller**: see jobset_controller.py.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .apiserver import ApiServer, pod_ready
from .jobset_controller import JobSetController
from .resources import (
    JOBS,
    NODES,
    PODS,
    RESOURCES,
    ApiError,
    Obj,
    condition,
    condition_true,
    deep,
    get_path,
    now_rfc3339,
    owner_ref_to,
    set_condition,
)
from .selectors import labels_of
from .store import Change

log = logging.getLogger(__name__)

NOT_READY_TAINT = "node.kubernetes.io/not-ready"
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"

_QUANTITY_SUFFIX = {
    "n": 1e-9,
    "u": 1e-6,
    "m": 1e-3,
    "": 1.0,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
    "Pi": 2.0**50,
    "Ei": 2.0**60,
}


def parse_quantity(q: Any) -> float:
    """resource.Quantity -> float (``"8"``, ``"500m"``, ``"16Gi"``, ``"1e3"``)."""
    if isinstance(q, int | float):
        return float(q)
    m = re.fullmatch(r"([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)", str(q).strip())
    if not m or m.group(2) not in _QUANTITY_SUFFIX:
        raise ValueError(f"invalid quantity {q!r}")
    return float(m.group(1)) * _QUANTITY_SUFFIX[m.group(2)]


def tolerates(tolerations: list[Obj], taint: Obj) -> Obj | None:
    """The toleration that tolerates ``taint`` (v1helper.TolerationsTolerateTaint), if any."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        op = t.get("operator") or "Equal"
        if op == "Exists":
            if not t.get("key") or t.get("key") == taint.get("key"):
                return t
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (
            taint.get("value") or ""
        ):
            return t
    return None


def pod_requests(pod: Obj) -> dict[str, float]:
    total: dict[str, float] = defaultdict(float)
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        reqs = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        for k, v in reqs.items():
            total[k] += parse_quantity(v)
    total["pods"] = 1
    return dict(total)


def _node_selector_term_matches(term: Obj, node: Obj) -> bool:
    labels = labels_of(node)
    for e in term.get("matchExpressions") or []:
        key, op, vals = e.get("key"), e.get("operator"), e.get("values") or []
        val = labels.get(key)
        ok = {
            "In": val is not None and val in vals,
            "NotIn": val is None or val not in vals,
            "Exists": val is not None,
            "DoesNotExist": val is None,
            "Gt": val is not None and val.isdigit() and vals and int(val) > int(vals[0]),
            "Lt": val is not None and val.isdigit() and vals and int(val) < int(vals[0]),
        }.get(op, False)
        if not ok:
            return False
    for e in term.get("matchFields") or []:
        if e.get("key") == "metadata.name":
            name = node["metadata"]["name"]
            vals = e.get("values") or []
            if (e.get("operator") == "In") != (name in vals):
                return False
    return True


def is_terminal(pod: Obj) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def is_terminating(pod: Obj) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


@dataclass
class _JobState:
    counted: set[str] = field(default_factory=set)
    expected_deletions: set[str] = field(default_factory=set)
    succeeded_indexes: set[int] = field(default_factory=set)


class Cluster:
    """Controller manager + scheduler + kubelets, on one background thread."""

    def __init__(self, api: ApiServer, *, tick: float = 0.05) -> None:
        self.api = api
        self.store = api.store
        self.time_scale = api.time_scale
        self.tick = tick
        self.stuck_pods: set[str] = set()  # pod uids whose termination never completes
        self.errors: list[BaseException] = []
        self.jobsets = JobSetController(api)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._deleted_pods: deque[Obj] = deque()
        self._jobs_state: dict[str, _JobState] = {}
        self._toleration_deadlines: dict[str, float] = {}
        self._ip = 0
        self.store.add_listener(self._on_change)
        self._thread = threading.Thread(target=self._run, name="fake-kube-controllers", daemon=True)

    # --- loop ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():  # never started with FakeKube(run_controllers=False)
            self._thread.join(timeout=5)

    def _on_change(self, change: Change) -> None:
        if change.resource == "pods" and change.type == "DELETED":
            self._deleted_pods.append(change.obj)
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.tick)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.reconcile()
            except Exception as e:  # surfaced by FakeKube.stop()
                log.exception("fake kube controller failed")
                self.errors.append(e)

    def reconcile(self) -> None:
        """Run every loop until nothing changes any more (bounded)."""
        for _ in range(25):
            before = self.store.resource_version
            for step in (
                self._garbage_collector,
                self._node_lifecycle,
                self._taint_eviction,
                self._kubelets,
                self._scheduler,
                self._job_controller,
                self.jobsets.reconcile,
            ):
                if self._stop.is_set():
                    return
                step()
            if self.store.resource_version == before:
                return

    def _try(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """Run one API write; a conflict or a vanished object is retried next pass."""
        try:
            fn(*args, **kwargs)
        except ApiError as e:
            if e.code not in (404, 409):
                raise
            self._wake.set()
            return False
        return True

    # --- garbage collector ----------------------------------------------------------

    def _garbage_collector(self) -> None:
        everything: list[tuple[Any, Obj]] = []
        for res in RESOURCES:
            everything.extend((res, o) for o in self.store.list(res.plural))
        uids = {o["metadata"]["uid"] for _, o in everything}
        dependents: dict[str, list[tuple[Any, Obj]]] = defaultdict(list)
        for res, o in everything:
            for ref in o["metadata"].get("ownerReferences") or []:
                dependents[ref.get("uid", "")].append((res, o))
        for res, o in everything:
            m = o["metadata"]
            ns, name, uid = m.get("namespace", ""), m["name"], m["uid"]
            finalizers = m.get("finalizers") or []
            if m.get("deletionTimestamp") and "orphan" in finalizers:
                for dres, dep in dependents.get(uid, []):
                    refs = [
                        r
                        for r in dep["metadata"].get("ownerReferences") or []
                        if r.get("uid") != uid
                    ]
                    patch: Obj = {"metadata": {"ownerReferences": refs or None}}
                    self._try(self._merge, dres, dep, patch)
                self._remove_finalizer(res, o, "orphan")
            elif m.get("deletionTimestamp") and "foregroundDeletion" in finalizers:
                deps = dependents.get(uid, [])
                for dres, dep in deps:
                    if not dep["metadata"].get("deletionTimestamp"):
                        dm = dep["metadata"]
                        self._try(
                            self.api.delete,
                            dres,
                            dm.get("namespace", ""),
                            dm["name"],
                            {"propagationPolicy": "Foreground"},
                        )
                blocking = [
                    d
                    for _, d in deps
                    if any(
                        r.get("uid") == uid and r.get("blockOwnerDeletion")
                        for r in d["metadata"].get("ownerReferences") or []
                    )
                ]
                if not blocking:
                    self._remove_finalizer(res, o, "foregroundDeletion")
            refs = m.get("ownerReferences") or []
            if refs:
                dangling = [r for r in refs if r.get("uid") not in uids]
                if dangling and len(dangling) == len(refs):
                    if not m.get("deletionTimestamp"):
                        self._try(
                            self.api.delete,
                            res,
                            ns,
                            name,
                            {"propagationPolicy": "Background", "preconditions": {"uid": uid}},
                        )
                elif dangling:
                    keep = [r for r in refs if r.get("uid") in uids]
                    self._try(self._merge, res, o, {"metadata": {"ownerReferences": keep}})

    def _merge(self, res: Any, obj: Obj, patch: Obj, subresource: str | None = None) -> Obj:
        m = obj["metadata"]
        body = {
            **patch,
            "metadata": {**patch.get("metadata", {}), "resourceVersion": m["resourceVersion"]},
        }
        return self.api.patch(
            res,
            m.get("namespace", ""),
            m["name"],
            "application/merge-patch+json",
            body,
            subresource=subresource,
            trusted=True,
        )

    def _remove_finalizer(self, res: Any, obj: Obj, finalizer: str) -> None:
        rest = [f for f in obj["metadata"].get("finalizers") or [] if f != finalizer]
        self._try(lambda: self._merge(res, obj, {"metadata": {"finalizers": rest or None}}))

    # --- node lifecycle and taint eviction ------------------------------------------------

    def _node_lifecycle(self) -> None:
        for node in self.store.list("nodes"):
            ready = condition_true(node, "Ready")
            taints = (node.get("spec") or {}).get("taints") or []
            has = [t for t in taints if t.get("key") == NOT_READY_TAINT]
            if not ready and len(has) < 2:
                new = [t for t in taints if t.get("key") != NOT_READY_TAINT] + [
                    {"key": NOT_READY_TAINT, "effect": "NoSchedule"},
                    {"key": NOT_READY_TAINT, "effect": "NoExecute", "timeAdded": now_rfc3339()},
                ]
                self._try(self._merge, NODES, node, {"spec": {"taints": new}})
            elif ready and has:
                new = [t for t in taints if t.get("key") != NOT_READY_TAINT]
                self._try(self._merge, NODES, node, {"spec": {"taints": new or None}})

    def _taint_eviction(self) -> None:
        nodes = {n["metadata"]["name"]: n for n in self.store.list("nodes")}
        now = time.monotonic()
        seen: set[str] = set()
        for pod in self.store.list("pods"):
            node = nodes.get((pod.get("spec") or {}).get("nodeName") or "")
            if node is None or is_terminating(pod) or is_terminal(pod):
                continue
            taints = [
                t
                for t in (node.get("spec") or {}).get("taints") or []
                if t.get("effect") == "NoExecute"
            ]
            if not taints:
                continue
            tols = (pod.get("spec") or {}).get("tolerations") or []
            matched = [tolerates(tols, t) for t in taints]
            m = pod["metadata"]
            if any(t is None for t in matched):
                self._evict_by_taint(m["namespace"], m["name"])
                continue
            secs = [
                t["tolerationSeconds"]
                for t in matched
                if t is not None and t.get("tolerationSeconds") is not None
            ]
            if secs:
                seen.add(m["uid"])
                deadline = self._toleration_deadlines.setdefault(
                    m["uid"], now + max(0, min(secs)) * self.time_scale
                )
                if now >= deadline:
                    self._evict_by_taint(m["namespace"], m["name"])
        for uid in list(self._toleration_deadlines):
            if uid not in seen:
                del self._toleration_deadlines[uid]

    def _evict_by_taint(self, ns: str, name: str) -> None:
        self._try(
            lambda: self.api.delete_with_disruption_target(
                ns, name, "DeletionByTaintManager", "Taint manager: deleting due to NoExecute taint"
            )
        )

    # --- kubelet --------------------------------------------------------------------------

    def _kubelets(self) -> None:
        nodes = {n["metadata"]["name"]: n for n in self.store.list("nodes")}
        now = time.monotonic()
        for pod in self.store.list("pods"):
            spec = pod.get("spec") or {}
            node_name = spec.get("nodeName")
            if not node_name:
                continue
            m = pod["metadata"]
            node = nodes.get(node_name)
            if node is None:
                # PodGC: pods bound to a node that no longer exists are force-deleted.
                self._try(
                    self.api.delete, PODS, m["namespace"], m["name"], {"gracePeriodSeconds": 0}
                )
                continue
            node_ready = condition_true(node, "Ready")
            if is_terminating(pod):
                if not node_ready or m["uid"] in self.stuck_pods:
                    continue
                deadline = self.api.term_deadlines.setdefault(
                    m["uid"], now + int(m.get("deletionGracePeriodSeconds") or 0) * self.time_scale
                )
                if now >= deadline:
                    self._finish_termination(pod)
                continue
            phase = (pod.get("status") or {}).get("phase")
            if not node_ready:
                if pod_ready(pod):
                    self._set_ready(pod, False, "NodeNotReady")
                continue
            if phase == "Pending":
                self._start_pod(pod, node)
            elif (
                phase == "Running"
                and not pod_ready(pod)
                and all(
                    c.get("ready") for c in (pod.get("status") or {}).get("containerStatuses") or []
                )
            ):
                self._set_ready(pod, True, "")

    def _status_write(self, pod: Obj, status: Obj) -> None:
        body = deep(pod)
        body["status"] = status
        m = pod["metadata"]
        self._try(
            lambda: self.api.update(
                PODS, m["namespace"], m["name"], body, subresource="status", trusted=True
            )
        )

    def _set_ready(self, pod: Obj, ready: bool, reason: str) -> None:
        p = deep(pod)
        for ctype in ("ContainersReady", "Ready"):
            cond: Obj = {"type": ctype, "status": "True" if ready else "False"}
            if reason:
                cond["reason"] = reason
            set_condition(p, cond)
        self._status_write(pod, p["status"])

    def _start_pod(self, pod: Obj, node: Obj) -> None:
        self._ip += 1
        ip = f"10.244.{self._ip // 250}.{self._ip % 250 + 1}"
        started = now_rfc3339()
        p = deep(pod)
        st = p.setdefault("status", {})
        st.update(
            {
                "phase": "Running",
                "hostIP": _node_ip(node),
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "startTime": started,
                "containerStatuses": [
                    {
                        "name": c["name"],
                        "image": c.get("image", ""),
                        "imageID": "",
                        "containerID": f"containerd://{p['metadata']['uid'].replace('-', '')}{i}",
                        "ready": True,
                        "started": True,
                        "restartCount": 0,
                        "state": {"running": {"startedAt": started}},
                    }
                    for i, c in enumerate((p.get("spec") or {}).get("containers") or [])
                ],
            }
        )
        for ctype in (
            "PodReadyToStartContainers",
            "Initialized",
            "ContainersReady",
            "Ready",
            "PodScheduled",
        ):
            set_condition(p, {"type": ctype, "status": "True"})
        self._status_write(pod, st)

    def _finish_termination(self, pod: Obj) -> None:
        m = pod["metadata"]
        if not is_terminal(pod):
            p = deep(pod)
            st = p.setdefault("status", {})
            st["phase"] = "Failed"
            finished = now_rfc3339()
            for cs in st.get("containerStatuses") or []:
                started = (cs.get("state") or {}).get("running", {}).get("startedAt", finished)
                cs["state"] = {
                    "terminated": {
                        "exitCode": 137,
                        "reason": "Error",
                        "startedAt": started,
                        "finishedAt": finished,
                    }
                }
                cs["ready"] = False
                cs["started"] = False
            for ctype in ("ContainersReady", "Ready"):
                set_condition(p, {"type": ctype, "status": "False", "reason": "PodFailed"})
            self._status_write(pod, st)
        self._try(
            lambda: self.api.delete(
                PODS,
                m["namespace"],
                m["name"],
                {"gracePeriodSeconds": 0, "preconditions": {"uid": m["uid"]}},
            )
        )

    def container_exit(self, ns: str, name: str, exit_code: int, reason: str) -> None:
        """What a kubelet reports when a pod's containers exit (used by FakeKube.fail_pod)."""
        pod = self.store.get("pods", ns, name)
        if pod is None:
            raise KeyError(f"pod {ns}/{name} not found")
        p = deep(pod)
        st = p.setdefault("status", {})
        finished = now_rfc3339()
        restart = (p.get("spec") or {}).get("restartPolicy", "Always")
        restarts_in_place = (exit_code != 0 and restart in ("Always", "OnFailure")) or (
            exit_code == 0 and restart == "Always"
        )
        for cs in st.get("containerStatuses") or []:
            started = (cs.get("state") or {}).get("running", {}).get("startedAt", finished)
            term = {
                "exitCode": exit_code,
                "reason": reason,
                "startedAt": started,
                "finishedAt": finished,
            }
            if restarts_in_place:
                cs["lastState"] = {"terminated": term}
                cs["restartCount"] = int(cs.get("restartCount", 0)) + 1
                cs["state"] = {"running": {"startedAt": finished}}
            else:
                cs["state"] = {"terminated": term}
                cs["ready"] = False
                cs["started"] = False
        if not restarts_in_place:
            st["phase"] = "Succeeded" if exit_code == 0 else "Failed"
            for ctype in ("ContainersReady", "Ready"):
                set_condition(
                    p,
                    {
                        "type": ctype,
                        "status": "False",
                        "reason": "PodCompleted" if exit_code == 0 else "PodFailed",
                    },
                )
        self.api.update(PODS, ns, name, p, subresource="status", trusted=True)

    # --- scheduler ------------------------------------------------------------------------

    def _scheduler(self) -> None:
        nodes = sorted(self.store.list("nodes"), key=lambda n: n["metadata"]["name"])
        pods = self.store.list("pods")
        used: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for p in pods:
            node_name = (p.get("spec") or {}).get("nodeName")
            if node_name and not is_terminal(p):
                for k, v in pod_requests(p).items():
                    used[node_name][k] += v
        pending = [
            p
            for p in pods
            if not (p.get("spec") or {}).get("nodeName")
            and not is_terminating(p)
            and (p.get("status") or {}).get("phase") == "Pending"
            and (p.get("spec") or {}).get("schedulerName", "default-scheduler")
            == "default-scheduler"
            and not (p.get("spec") or {}).get("schedulingGates")
        ]
        pending.sort(
            key=lambda p: (
                p["metadata"]["creationTimestamp"],
                int(p["metadata"]["resourceVersion"]),
            )
        )
        for pod in pending:
            reasons: Counter[str] = Counter()
            chosen = None
            for node in nodes:
                why = self._unfit(pod, node, used[node["metadata"]["name"]])
                if why is None:
                    chosen = node
                    break
                reasons[why] += 1
            m = pod["metadata"]
            if chosen is not None:
                for k, v in pod_requests(pod).items():
                    used[chosen["metadata"]["name"]][k] += v
                self._bind(pod, chosen["metadata"]["name"])
            else:
                detail = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items()))
                msg = (
                    f"0/{len(nodes)} nodes are available: {detail}."
                    if detail
                    else f"0/{len(nodes)} nodes are available."
                )
                p = deep(pod)
                if set_condition(
                    p,
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": msg,
                    },
                    time_field="lastTransitionTime",
                ):
                    self._try(
                        self.api.update,
                        PODS,
                        m["namespace"],
                        m["name"],
                        p,
                        subresource="status",
                        trusted=True,
                    )

    def _unfit(self, pod: Obj, node: Obj, used: dict[str, float]) -> str | None:
        spec = pod.get("spec") or {}
        nspec = node.get("spec") or {}
        tols = spec.get("tolerations") or []
        if not condition_true(node, "Ready") and not tolerates(
            tols, {"key": NOT_READY_TAINT, "effect": "NoSchedule"}
        ):
            return f"node(s) had untolerated taint {{{NOT_READY_TAINT}: }}"
        if nspec.get("unschedulable") and not tolerates(
            tols, {"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule"}
        ):
            return "node(s) were unschedulable"
        labels = labels_of(node)
        selector = spec.get("nodeSelector") or {}
        terms = get_path(
            spec,
            "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms",
        )
        if any(labels.get(k) != v for k, v in selector.items()) or (
            terms and not any(_node_selector_term_matches(t, node) for t in terms)
        ):
            return "node(s) didn't match Pod's node affinity/selector"
        for t in nspec.get("taints") or []:
            if t.get("effect") in ("NoSchedule", "NoExecute") and tolerates(tols, t) is None:
                return f"node(s) had untolerated taint {{{t.get('key')}: {t.get('value') or ''}}}"
        status = node.get("status") or {}
        alloc = status.get("allocatable") or status.get("capacity") or {}
        for k, v in pod_requests(pod).items():
            if k == "pods":
                limit = parse_quantity(alloc.get("pods", 110))
                if used.get("pods", 0) + v > limit:
                    return "Too many pods"
                continue
            if k in ("cpu", "memory", "ephemeral-storage") and k not in alloc:
                continue  # a node that declares no cpu/memory is treated as unlimited
            if used.get(k, 0) + v > parse_quantity(alloc.get(k, 0)):
                return f"Insufficient {k}"
        return None

    def _bind(self, pod: Obj, node_name: str) -> None:
        """pods/binding: spec.nodeName and PodScheduled=True."""
        m = pod["metadata"]
        p = deep(pod)
        p["spec"]["nodeName"] = node_name
        set_condition(p, {"type": "PodScheduled", "status": "True"})

        def bind() -> None:
            with self.store.lock:
                current = self.store.raw("pods", m["namespace"], m["name"])
                if (
                    current is None
                    or current["metadata"]["resourceVersion"] != m["resourceVersion"]
                ):
                    raise ApiError(409, "Conflict", "pod changed")
                if current["metadata"].get("deletionTimestamp") or (current.get("spec") or {}).get(
                    "nodeName"
                ):
                    return
                self.store.put("pods", p)

        self._try(bind)

    # --- job controller -------------------------------------------------------------------

    def _job_controller(self) -> None:
        gone: dict[str, list[Obj]] = defaultdict(list)
        while self._deleted_pods:
            p = self._deleted_pods.popleft()
            for ref in p["metadata"].get("ownerReferences") or []:
                if ref.get("controller") and ref.get("kind") == "Job":
                    gone[ref["uid"]].append(p)
        pods_by_job: dict[str, list[Obj]] = defaultdict(list)
        for p in self.store.list("pods"):
            for ref in p["metadata"].get("ownerReferences") or []:
                if ref.get("controller") and ref.get("kind") == "Job":
                    pods_by_job[ref["uid"]].append(p)
        live = set()
        for job in self.store.list("jobs"):
            uid = job["metadata"]["uid"]
            live.add(uid)
            self._sync_job(job, pods_by_job.get(uid, []), gone.get(uid, []))
        for uid in list(self._jobs_state):
            if uid not in live:
                del self._jobs_state[uid]

    def _sync_job(self, job: Obj, pods: list[Obj], gone: list[Obj]) -> None:
        m = job["metadata"]
        if m.get("deletionTimestamp"):
            return
        spec = job.get("spec") or {}
        st = self._jobs_state.setdefault(m["uid"], _JobState())
        counted, succeeded_indexes = set(st.counted), set(st.succeeded_indexes)
        status = deep(job.get("status") or {})
        j = deep(job)
        j["status"] = status
        indexed = spec.get("completionMode") == "Indexed"
        only_failed = spec.get("podReplacementPolicy") == "Failed" or bool(
            spec.get("podFailurePolicy")
        )
        active = [p for p in pods if not is_terminal(p) and not is_terminating(p)]
        terminating = [p for p in pods if is_terminating(p) and not is_terminal(p)]

        failure: tuple[str, str] | None = None
        for p, removed in [(p, False) for p in pods] + [(p, True) for p in gone]:
            puid = p["metadata"]["uid"]
            if puid in counted or puid in st.expected_deletions:
                continue
            phase = (p.get("status") or {}).get("phase")
            if phase == "Succeeded":
                counted.add(puid)
                status["succeeded"] = int(status.get("succeeded", 0)) + 1
                idx = _completion_index(p)
                if idx is not None:
                    succeeded_indexes.add(idx)
                continue
            failed = phase == "Failed" or removed or (is_terminating(p) and not only_failed)
            if not failed:
                continue
            counted.add(puid)
            action, detail = _pod_failure_policy(spec, p)
            if action == "Ignore":
                continue
            status["failed"] = int(status.get("failed", 0)) + 1
            if action == "FailJob" and failure is None:
                failure = ("PodFailurePolicy", detail)
        if failure is None and (
            int(status.get("failed", 0)) > int(spec.get("backoffLimit", 6))
            or _past_backoff_on_failure(spec, active)
        ):
            failure = ("BackoffLimitExceeded", "Job has reached the specified backoff limit")

        finished = condition_true(job, "Complete") or condition_true(job, "Failed")
        if not finished:
            if failure is not None and not condition_true(job, "FailureTarget"):
                set_condition(
                    j,
                    {
                        "type": "FailureTarget",
                        "status": "True",
                        "reason": failure[0],
                        "message": failure[1],
                    },
                )
            target = condition(j, "FailureTarget")
            if target is not None and target.get("status") == "True":
                self._delete_job_pods(st, active)
                if not active and not terminating:
                    set_condition(
                        j,
                        {
                            "type": "Failed",
                            "status": "True",
                            "reason": target.get("reason", ""),
                            "message": target.get("message", ""),
                        },
                    )
            else:
                completions = spec.get("completions")
                if indexed and completions is not None:
                    done = all(i in succeeded_indexes for i in range(int(completions)))
                else:
                    done = completions is not None and int(status.get("succeeded", 0)) >= int(
                        completions
                    )
                if done:
                    set_condition(
                        j,
                        {
                            "type": "SuccessCriteriaMet",
                            "status": "True",
                            "reason": "CompletionsReached",
                            "message": "Reached expected number of succeeded pods",
                        },
                    )
                    self._delete_job_pods(st, active)
                    if not active and not terminating:
                        set_condition(
                            j,
                            {
                                "type": "Complete",
                                "status": "True",
                                "reason": "CompletionsReached",
                                "message": "Reached expected number of succeeded pods",
                            },
                        )
                        status.setdefault("completionTime", now_rfc3339())
                elif spec.get("suspend"):
                    self._delete_job_pods(st, active)
                    active = []
                    set_condition(
                        j,
                        {
                            "type": "Suspended",
                            "status": "True",
                            "reason": "JobSuspended",
                            "message": "Job suspended",
                        },
                    )
                else:
                    if condition_true(job, "Suspended"):
                        set_condition(
                            j,
                            {
                                "type": "Suspended",
                                "status": "False",
                                "reason": "JobResumed",
                                "message": "Job resumed",
                            },
                        )
                    status.setdefault("startTime", now_rfc3339())
                    self._create_job_pods(
                        job,
                        succeeded_indexes,
                        int(status.get("succeeded", 0)),
                        active,
                        terminating,
                        only_failed,
                        indexed,
                    )
        elif condition_true(job, "Failed"):
            self._delete_job_pods(st, active)
        status["active"] = len(
            [p for p in active if p["metadata"]["uid"] not in st.expected_deletions]
        )
        status["ready"] = len([p for p in active if pod_ready(p)])
        status["terminating"] = len(terminating)
        status.setdefault("failed", 0)
        status.setdefault("succeeded", 0)
        written = status == (job.get("status") or {}) or self._try(
            self.api.update, JOBS, m["namespace"], m["name"], j, subresource="status", trusted=True
        )
        if written:
            st.counted, st.succeeded_indexes = counted, succeeded_indexes
        else:  # nothing counted in this pass is recorded: count it again next time
            self._deleted_pods.extend(gone)

    def _delete_job_pods(self, st: _JobState, pods: list[Obj]) -> None:
        for p in pods:
            pm = p["metadata"]
            st.expected_deletions.add(pm["uid"])
            self._try(
                self.api.delete,
                PODS,
                pm["namespace"],
                pm["name"],
                {"preconditions": {"uid": pm["uid"]}},
            )

    def _create_job_pods(
        self,
        job: Obj,
        succeeded: set[int],
        succeeded_count: int,
        active: list[Obj],
        terminating: list[Obj],
        only_failed: bool,
        indexed: bool,
    ) -> None:
        spec = job.get("spec") or {}
        parallelism = int(spec.get("parallelism", 1))
        completions = spec.get("completions")
        running = len(active)
        if indexed:
            have = {_completion_index(p) for p in active}
            blocked = {_completion_index(p) for p in terminating} if only_failed else set()
            for idx in range(int(completions if completions is not None else parallelism)):
                if running >= parallelism:
                    break
                if idx in succeeded or idx in have or idx in blocked:
                    continue
                self._try(self._create_pod, job, idx)
                running += 1
        else:
            want = parallelism
            if completions is not None:
                want = min(
                    parallelism,
                    int(completions) - succeeded_count,
                )
            missing = want - running - (len(terminating) if only_failed else 0)
            for _ in range(max(0, missing)):
                self._try(lambda: self._create_pod(job, None))

    def _create_pod(self, job: Obj, index: int | None) -> None:
        m = job["metadata"]
        template = deep((job.get("spec") or {}).get("template") or {})
        tmeta = template.get("metadata") or {}
        labels = dict(tmeta.get("labels") or {})
        annotations = dict(tmeta.get("annotations") or {})
        pspec = template.get("spec") or {}
        if index is not None:
            labels["batch.kubernetes.io/job-completion-index"] = str(index)
            annotations["batch.kubernetes.io/job-completion-index"] = str(index)
            pspec.setdefault("hostname", f"{m['name']}-{index}")
            generate = f"{m['name']}-{index}-"
        else:
            generate = f"{m['name']}-"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "generateName": generate,
                "namespace": m["namespace"],
                "labels": labels,
                "annotations": annotations,
                "ownerReferences": [owner_ref_to(job, JOBS)],
            },
            "spec": pspec,
        }
        self.api.create(PODS, m["namespace"], pod)

    # --- helpers for FakeKube ---------------------------------------------------------------


def _node_ip(node: Obj) -> str:
    for a in (node.get("status") or {}).get("addresses") or []:
        if a.get("type") == "InternalIP":
            return str(a.get("address"))
    return "10.0.0.1"


def _completion_index(pod: Obj) -> int | None:
    v = (pod["metadata"].get("annotations") or {}).get("batch.kubernetes.io/job-completion-index")
    return int(v) if v is not None and str(v).isdigit() else None


def _past_backoff_on_failure(spec: Obj, active: list[Obj]) -> bool:
    template_spec = (spec.get("template") or {}).get("spec") or {}
    if template_spec.get("restartPolicy") != "OnFailure":
        return False
    restarts = sum(
        int(cs.get("restartCount", 0))
        for p in active
        if (p.get("status") or {}).get("phase") in ("Running", "Pending")
        for cs in (p.get("status") or {}).get("containerStatuses") or []
    )
    limit = int(spec.get("backoffLimit", 6))
    return restarts > 0 if limit == 0 else restarts >= limit


def _pod_failure_policy(spec: Obj, pod: Obj) -> tuple[str | None, str]:
    """First matching podFailurePolicy rule: (action, message) as the job controller words it."""
    rules = (spec.get("podFailurePolicy") or {}).get("rules") or []
    pm = pod["metadata"]
    for i, rule in enumerate(rules):
        action = rule.get("action")
        for pc in rule.get("onPodConditions") or []:
            c = condition(pod, pc.get("type", ""))
            if c is not None and c.get("status") == pc.get("status", "True"):
                return (
                    action,
                    f"Pod {pm['namespace']}/{pm['name']} has condition {pc['type']} "
                    f"matching {action} rule at index {i}",
                )
        codes = rule.get("onExitCodes")
        if codes:
            for cs in (pod.get("status") or {}).get("containerStatuses") or []:
                if codes.get("containerName") and codes["containerName"] != cs.get("name"):
                    continue
                term = (cs.get("state") or {}).get("terminated")
                if not term or term.get("exitCode") == 0:
                    continue
                inside = term.get("exitCode") in (codes.get("values") or [])
                if inside == (codes.get("operator") == "In"):
                    return action, (
                        f"Container {cs.get('name')} for pod {pm['namespace']}/{pm['name']} "
                        "failed with exit code "
                        f"{term.get('exitCode')} matching {action} rule at index {i}"
                    )
    return None, ""

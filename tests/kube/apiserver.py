"""The API semantics of the fake: what kube-apiserver does between HTTP and etcd.

Modelled, each as the real generic registry
(``k8s.io/apiserver/pkg/registry/generic/registry/store.go``) and the per-kind strategies
do it:

- create: ``generateName``, uid, creationTimestamp, generation 1; 409 AlreadyExists;
  status reset on create for kinds with a status subresource (Pod -> phase Pending,
  Job/PDB/JobSet -> empty); defaulting (pod terminationGracePeriodSeconds 30, default
  not-ready/unreachable tolerations of 300 s, job selector and labels, JobSet webhook
  defaults).
- update (PUT): 409 Conflict on a stale ``metadata.resourceVersion`` and on a uid that is
  not the stored one ("Precondition failed: UID in precondition"); custom resources
  refuse an update without resourceVersion (422), built-ins allow it (unconditional);
  system metadata (uid, creationTimestamp, generation, deletionTimestamp) cannot be
  changed; the main resource ignores ``status`` and ``/status`` ignores everything else;
  generation is bumped when the spec changes; a write that changes nothing is a no-op
  (no new resourceVersion, no watch event); no finalizer may be added to an object
  being deleted.
- patch: the patch is applied to the stored object, then treated as an update; a
  ``metadata.resourceVersion`` in the patch is a precondition (409 when stale).
- delete: preconditions (uid, resourceVersion) -> 409; propagationPolicy Orphan /
  Background / Foreground through the ``orphan`` and ``foregroundDeletion``
  finalizers (the garbage collector in controllers.py finishes the job); the default
  for batch/v1 Jobs is Orphan (pods are left behind), Background for everything else;
  graceful deletion of pods (deletionTimestamp + deletionGracePeriodSeconds, grace
  from the request or spec.terminationGracePeriodSeconds; 0 for unscheduled or
  terminal pods; a later delete can only shorten it; gracePeriodSeconds=0 removes the
  object at once unless it has finalizers).
- the pods/eviction subresource, as ``pkg/registry/core/pod/storage/eviction.go`` for
  a pod no PodDisruptionBudget covers.
"""

from __future__ import annotations

import base64
import json
import random
import re
import time
import uuid
from typing import Any

from . import patch as patching
from .resources import (
    JOBS,
    JOBSETS,
    LEASES,
    NODES,
    PODS,
    ApiError,
    Obj,
    Resource,
    already_exists,
    bad_request,
    condition_true,
    conflict,
    deep,
    expired,
    forbidden,
    invalid,
    meta,
    not_found,
    now_rfc3339,
    set_condition,
)
from .selectors import (
    Matcher,
    matcher,
    parse_field_selector,
    parse_label_selector,
)
from .store import Change, Store

_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_GEN_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery/pkg/util/rand alphabet
_SYSTEM_META = (
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
)


def random_suffix(n: int = 5) -> str:
    return "".join(random.choice(_GEN_CHARS) for _ in range(n))


def with_type(res: Resource, obj: Obj) -> Obj:
    obj["apiVersion"] = res.api_version
    obj["kind"] = res.kind
    return obj


def status_success(res: Resource, name: str, uid: str, code: int | None = None) -> Obj:
    s: Obj = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "details": {"name": name, "kind": res.plural, "uid": uid},
    }
    if res.group:
        s["details"]["group"] = res.group
    if code is not None:
        s["code"] = code
    return s


def _short(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))[:200]


def pod_ready(pod: Obj) -> bool:
    return condition_true(pod, "Ready")


class ApiServer:
    def __init__(self, store: Store, *, time_scale: float = 1.0) -> None:
        self.store = store
        self.time_scale = time_scale
        # pod uid -> monotonic time at which its kubelet finishes a graceful termination
        self.term_deadlines: dict[str, float] = {}

    # --- reads ----------------------------------------------------------------

    def get(self, res: Resource, ns: str, name: str) -> Obj:
        obj = self.store.get(res.plural, ns if res.namespaced else "", name)
        if obj is None:
            raise not_found(res, name)
        return with_type(res, obj)

    def list(
        self,
        res: Resource,
        ns: str | None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        limit: int | None = None,
        cont: str | None = None,
    ) -> Obj:
        """A List; items sorted by namespace/name. ``limit``/``continue`` paginate.

        Unlike etcd, later pages are read from the current state, not from a snapshot
        at the first page's resourceVersion; a continue token older than the
        compaction point is 410 Expired, as on a real server.
        """
        m = matcher(parse_label_selector(label_selector), parse_field_selector(field_selector, res))
        with self.store.lock:
            list_rv = self.store.resource_version
            start: tuple[str, str] | None = None
            if cont:
                try:
                    token = json.loads(base64.b64decode(cont))
                    token_rv, start = int(token["rv"]), (token["start"][0], token["start"][1])
                except (ValueError, KeyError, TypeError, IndexError) as e:
                    raise bad_request(f"invalid continue token: {e}") from e
                if token_rv < self.store.compacted:
                    raise expired(
                        "The provided continue parameter is too old to display a consistent list "
                        "result. You can start a new list without the continue parameter."
                    )
                list_rv = token_rv
            items = [
                o
                for o in self.store.list(res.plural, ns if res.namespaced else None)
                if m(o)
                and (
                    start is None
                    or (o["metadata"].get("namespace", ""), o["metadata"]["name"]) > start
                )
            ]
        list_meta: Obj = {"resourceVersion": str(list_rv)}
        if limit and limit > 0 and len(items) > limit:
            last = items[limit - 1]["metadata"]
            token = {"rv": list_rv, "start": [last.get("namespace", ""), last["name"]]}
            list_meta["continue"] = base64.b64encode(json.dumps(token).encode()).decode()
            list_meta["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        for o in items:
            if res.custom:
                with_type(res, o)
            else:  # built-in list items carry no apiVersion/kind
                o.pop("apiVersion", None)
                o.pop("kind", None)
        return {
            "apiVersion": res.api_version,
            "kind": res.kind + "List",
            "metadata": list_meta,
            "items": items,
        }

    # --- watch support ----------------------------------------------------------

    def watch_matcher(
        self, res: Resource, label_selector: str | None, field_selector: str | None
    ) -> Matcher:
        return matcher(
            parse_label_selector(label_selector), parse_field_selector(field_selector, res)
        )

    @staticmethod
    def watch_event(change: Change, res: Resource, ns: str | None, m: Matcher) -> Obj | None:
        """Translate a store change into a watch event for one watcher.

        As the API server's watch filtering does: an object that stops matching the
        selector is sent as DELETED, one that starts matching as ADDED.
        """
        if change.resource != res.plural:
            return None
        if ns is not None and change.obj["metadata"].get("namespace") != ns:
            return None
        new_match = m(change.obj)
        old_match = change.old is not None and m(change.old)
        if change.type == "ADDED":
            etype = "ADDED" if new_match else None
        elif change.type == "DELETED":
            etype = "DELETED" if new_match else None
        elif new_match and old_match:
            etype = "MODIFIED"
        elif new_match:
            etype = "ADDED"
        elif old_match:
            etype = "DELETED"
        else:
            etype = None
        if etype is None:
            return None
        return {"type": etype, "object": with_type(res, deep(change.obj))}

    # --- create -----------------------------------------------------------------

    def create(self, res: Resource, ns: str, body: Any, *, keep_status: bool = False) -> Obj:
        if not isinstance(body, dict):
            raise bad_request("the body of the request must be a JSON object")
        obj = deep(body)
        self._check_type(res, obj)
        m = meta(obj)
        if res.namespaced:
            if m.get("namespace") and m["namespace"] != ns:
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent "
                    "on the request"
                )
            m["namespace"] = ns
        else:
            m.pop("namespace", None)
        if not m.get("name"):
            if m.get("generateName"):
                m["name"] = m["generateName"] + random_suffix()
            else:
                raise invalid(
                    res, "", [("metadata.name", "Required", "name or generateName is required")]
                )
        name = m["name"]
        if not _NAME_RE.match(name) or len(name) > 253:
            raise invalid(
                res,
                name,
                [
                    (
                        "metadata.name",
                        "Invalid",
                        f'"{name}": a lowercase RFC 1123 subdomain must consist of lower case '
                        "alphanumeric characters, '-' or '.', and must start and end with an "
                        "alphanumeric character",
                    )
                ],
            )
        with self.store.lock:
            if self.store.raw(res.plural, m.get("namespace", ""), name) is not None:
                raise already_exists(res, name)
            for k in _SYSTEM_META:
                m.pop(k, None)
            m.pop("resourceVersion", None)
            m["uid"] = str(uuid.uuid4())
            m["creationTimestamp"] = now_rfc3339()
            if res.has_generation:
                m["generation"] = 1
            if res.status_subresource and not keep_status:
                obj.pop("status", None)
            self._prepare_create(res, obj, keep_status=keep_status)
            self._validate_create(res, obj)
            return with_type(res, self.store.put(res.plural, with_type(res, obj)))

    def _check_type(self, res: Resource, obj: Obj) -> None:
        if obj.get("kind") and obj["kind"] != res.kind:
            raise bad_request(
                f"the kind in the data ({obj['kind']}) does not match the expected kind "
                f"({res.kind})"
            )
        if obj.get("apiVersion") and obj["apiVersion"] != res.api_version:
            raise bad_request(
                f"the API version in the data ({obj['apiVersion']}) does not match the expected "
                f"API version ({res.api_version})"
            )

    # --- update / patch -----------------------------------------------------------

    def update(
        self,
        res: Resource,
        ns: str,
        name: str,
        body: Any,
        *,
        subresource: str | None = None,
        trusted: bool = False,
    ) -> Obj:
        if not isinstance(body, dict):
            raise bad_request("the body of the request must be a JSON object")
        ns = ns if res.namespaced else ""
        with self.store.lock:
            old = self.store.raw(res.plural, ns, name)
            if old is None:
                if res.allow_create_on_update and subresource is None:
                    return self.create(res, ns, body)
                raise not_found(res, name)
            self._check_type(res, body)
            m = meta(body)
            if m.get("name") and m["name"] != name:
                raise bad_request(
                    f"the name of the object ({m['name']}) does not match the name on the URL "
                    f"({name})"
                )
            if res.namespaced and m.get("namespace") and m["namespace"] != ns:
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent "
                    "on the request"
                )
            rv = m.get("resourceVersion")
            if not rv:
                if not res.allow_unconditional_update and not trusted:
                    raise invalid(
                        res,
                        name,
                        [
                            (
                                "metadata.resourceVersion",
                                "Invalid",
                                "0x0: must be specified for an update",
                            )
                        ],
                    )
            elif rv != old["metadata"]["resourceVersion"]:
                raise conflict(res, name)
            uid = m.get("uid")
            if uid and uid != old["metadata"]["uid"]:
                raise conflict(
                    res,
                    name,
                    f"Precondition failed: UID in precondition: {uid}, "
                    f"UID in object meta: {old['metadata']['uid']}",
                )
            new = self._prepare_update(res, old, deep(body), subresource, trusted)
            return self._commit_update(res, old, new)

    def patch(
        self,
        res: Resource,
        ns: str,
        name: str,
        content_type: str,
        body: Any,
        *,
        subresource: str | None = None,
        trusted: bool = False,
    ) -> Obj:
        ns = ns if res.namespaced else ""
        with self.store.lock:
            old = self.store.raw(res.plural, ns, name)
            if old is None:
                raise not_found(res, name)
            current = with_type(res, deep(old))
            patched = patching.apply_patch(content_type, current, body, res.plural, res.custom)
            pm = meta(patched)
            if pm.get("name") != name or (res.namespaced and pm.get("namespace") != ns):
                raise bad_request(
                    "metadata.name and metadata.namespace cannot be changed by a patch"
                )
            prv = pm.get("resourceVersion")
            if prv and prv != old["metadata"]["resourceVersion"]:
                raise conflict(res, name)
            pm["resourceVersion"] = old["metadata"]["resourceVersion"]
            if pm.get("uid") != old["metadata"]["uid"]:
                raise conflict(
                    res,
                    name,
                    f"Precondition failed: UID in precondition: {pm.get('uid')}, "
                    f"UID in object meta: {old['metadata']['uid']}",
                )
            self._check_type(res, patched)
            new = self._prepare_update(res, old, patched, subresource, trusted)
            return self._commit_update(res, old, new)

    def _prepare_update(
        self, res: Resource, old: Obj, new: Obj, subresource: str | None, trusted: bool
    ) -> Obj:
        om = old["metadata"]
        nm = meta(new)
        for k in _SYSTEM_META:
            if k in om:
                nm[k] = deep(om[k])
            else:
                nm.pop(k, None)
        nm["name"] = om["name"]
        if res.namespaced:
            nm["namespace"] = om["namespace"]
        nm["resourceVersion"] = om["resourceVersion"]
        with_type(res, new)
        if res.status_subresource:
            if subresource == "status":
                status = new.get("status")
                new = with_type(res, deep(old))
                if status is None:
                    new.pop("status", None)
                else:
                    new["status"] = status
                nm = new["metadata"]
            elif "status" in old:
                new["status"] = deep(old["status"])
            else:
                new.pop("status", None)
        if om.get("deletionTimestamp"):
            added = [f for f in nm.get("finalizers") or [] if f not in (om.get("finalizers") or [])]
            if added:
                raise invalid(
                    res,
                    om["name"],
                    [
                        (
                            "metadata.finalizers",
                            "Forbidden",
                            "no new finalizers can be added if the object is being deleted, "
                            f"found new finalizers {added}",
                        )
                    ],
                )
        if not trusted:
            self._validate_update(res, old, new, subresource)
        if res.has_generation and self._spec_of(res, new) != self._spec_of(res, old):
            nm["generation"] = int(om.get("generation", 1)) + 1
        return new

    @staticmethod
    def _spec_of(res: Resource, obj: Obj) -> Any:
        if res.custom:
            return {
                k: v
                for k, v in obj.items()
                if k not in ("metadata", "status", "apiVersion", "kind")
            }
        return obj.get("spec")

    def _commit_update(self, res: Resource, old: Obj, new: Obj) -> Obj:
        if new == with_type(res, deep(old)):
            return new  # nothing changed: no write, no new resourceVersion, no event
        nm = new["metadata"]
        if (
            nm.get("deletionTimestamp")
            and not nm.get("finalizers")
            and nm.get("deletionGracePeriodSeconds") == 0
        ):
            # The last finalizer of an object being deleted is gone: the object goes.
            self.store.put(res.plural, new)
            gone = self.store.remove(res.plural, nm.get("namespace", ""), nm["name"])
            return with_type(res, gone or new)
        return with_type(res, self.store.put(res.plural, new))

    # --- delete -------------------------------------------------------------------

    def delete(
        self, res: Resource, ns: str, name: str, options: Obj | None = None
    ) -> tuple[int, Obj]:
        opts = options or {}
        ns = ns if res.namespaced else ""
        with self.store.lock:
            old = self.store.raw(res.plural, ns, name)
            if old is None:
                raise not_found(res, name)
            om = old["metadata"]
            pre = opts.get("preconditions") or {}
            if pre.get("uid") and pre["uid"] != om["uid"]:
                raise conflict(
                    res,
                    name,
                    f"Precondition failed: UID in precondition: {pre['uid']}, "
                    f"UID in object meta: {om['uid']}",
                )
            if pre.get("resourceVersion") and pre["resourceVersion"] != om["resourceVersion"]:
                raise conflict(
                    res,
                    name,
                    "Precondition failed: ResourceVersion in precondition: "
                    f"{pre['resourceVersion']}, "
                    f"ResourceVersion in object meta: {om['resourceVersion']}",
                )
            policy = opts.get("propagationPolicy")
            orphan = opts.get("orphanDependents")
            if policy is not None and orphan is not None:
                raise invalid(
                    res,
                    name,
                    [
                        (
                            "propagationPolicy",
                            "Invalid",
                            f'"{policy}": orphanDependents and propagationPolicy cannot '
                            "both be set",
                        )
                    ],
                )
            if policy is None:
                if orphan is not None:
                    policy = "Orphan" if orphan else "Background"
                else:
                    # batch/v1 Jobs keep the legacy default: orphan their pods.
                    policy = "Orphan" if res is JOBS else "Background"
            if policy not in ("Orphan", "Background", "Foreground"):
                raise invalid(
                    res,
                    name,
                    [
                        (
                            "propagationPolicy",
                            "NotSupported",
                            f'"{policy}": supported values: "Foreground", "Background", "Orphan"',
                        )
                    ],
                )
            grace = opts.get("gracePeriodSeconds")
            period = 0
            if res is PODS:
                spec = old.get("spec") or {}
                period = (
                    int(grace)
                    if grace is not None
                    else int(spec.get("terminationGracePeriodSeconds", 30))
                )
                if not spec.get("nodeName"):
                    period = 0
                if (old.get("status") or {}).get("phase") in ("Failed", "Succeeded"):
                    period = 0
            obj = deep(old)
            m = obj["metadata"]
            finalizers = list(m.get("finalizers") or [])
            accepted = 202 if orphan is False else 200
            if m.get("deletionTimestamp"):
                current = int(m.get("deletionGracePeriodSeconds") or 0)
                if res is PODS and period < current:
                    m["deletionTimestamp"] = now_rfc3339(period)
                    m["deletionGracePeriodSeconds"] = period
                    self.term_deadlines[m["uid"]] = time.monotonic() + period * self.time_scale
                    if period == 0 and not finalizers:
                        return 200, self._remove(res, obj)
                    return accepted, with_type(res, self.store.put(res.plural, obj))
                return accepted, with_type(res, obj)
            gc = {"Orphan": "orphan", "Foreground": "foregroundDeletion"}.get(policy)
            if gc and gc not in finalizers:
                finalizers.append(gc)
            if period > 0 or finalizers:
                m["deletionTimestamp"] = now_rfc3339(period)
                m["deletionGracePeriodSeconds"] = period
                if finalizers:
                    m["finalizers"] = finalizers
                if res.has_generation:
                    m["generation"] = int(m.get("generation", 1)) + 1
                if res is PODS and period > 0:
                    self.term_deadlines[m["uid"]] = time.monotonic() + period * self.time_scale
                return accepted, with_type(res, self.store.put(res.plural, obj))
            return 200, self._remove(res, obj)

    def _remove(self, res: Resource, obj: Obj) -> Obj:
        m = obj["metadata"]
        gone = self.store.remove(res.plural, m.get("namespace", ""), m["name"])
        self.term_deadlines.pop(m["uid"], None)
        if res.return_deleted_object:
            return with_type(res, gone or obj)
        return status_success(res, m["name"], m["uid"])

    # --- eviction -----------------------------------------------------------------

    def evict(self, ns: str, name: str, body: Any) -> tuple[int, Obj]:
        """POST pods/{name}/eviction (policy/v1 Eviction).

        As ``EvictionREST.Create`` for a pod no PodDisruptionBudget covers (budgets are
        not modelled: a refused eviction is tested on the real control plane): the pod
        gets the condition ``DisruptionTarget`` (reason EvictionByEvictionAPI) and is
        deleted with the eviction's deleteOptions (graceful by default).
        """
        if not isinstance(body, dict):
            raise bad_request("the body of the request must be a JSON object")
        if (body.get("metadata") or {}).get("name") != name:
            raise bad_request("name in URL does not match name in Eviction object")
        opts = body.get("deleteOptions") or {}
        with self.store.lock:
            if self.store.raw("pods", ns, name) is None:
                raise not_found(PODS, name)
            self._add_disruption_target_and_delete(ns, name, opts)
            return 201, {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Success",
                "code": 201,
            }

    def _add_disruption_target_and_delete(
        self,
        ns: str,
        name: str,
        opts: Obj,
        *,
        reason: str = "EvictionByEvictionAPI",
        message: str = "Eviction API: evicting",
    ) -> tuple[int, Obj]:
        pod = deep(self.store.raw("pods", ns, name))
        if set_condition(
            pod,
            {"type": "DisruptionTarget", "status": "True", "reason": reason, "message": message},
        ):
            self.store.put("pods", pod)
        return self.delete(PODS, ns, name, opts)

    def delete_with_disruption_target(self, ns: str, name: str, reason: str, message: str) -> None:
        """What the taint-eviction controller does: add DisruptionTarget, then delete."""
        with self.store.lock:
            if self.store.raw("pods", ns, name) is None:
                return
            self._add_disruption_target_and_delete(ns, name, {}, reason=reason, message=message)

    # --- per-kind strategies --------------------------------------------------------

    def _prepare_create(self, res: Resource, obj: Obj, *, keep_status: bool) -> None:
        if res is PODS:
            spec = obj.setdefault("spec", {})
            _default_pod_spec(spec)
            if not keep_status or "status" not in obj:
                obj["status"] = {"phase": "Pending", "qosClass": _qos_class(spec)}
        elif res is JOBS:
            _default_job(obj)
            if not keep_status:
                obj["status"] = {}
        elif res is JOBSETS:
            _default_jobset(obj)

    def _validate_create(self, res: Resource, obj: Obj) -> None:
        name = obj["metadata"]["name"]
        if res is PODS:
            containers = (obj.get("spec") or {}).get("containers") or []
            if not containers:
                raise invalid(res, name, [("spec.containers", "Required", "")])
        elif res is JOBS:
            rp = (((obj.get("spec") or {}).get("template") or {}).get("spec") or {}).get(
                "restartPolicy"
            )
            if rp not in ("OnFailure", "Never"):
                raise invalid(
                    res,
                    name,
                    [
                        (
                            "spec.template.spec.restartPolicy",
                            "NotSupported",
                            f'"{rp}": supported values: "OnFailure", "Never"',
                        )
                    ],
                )
        elif res is LEASES:
            d = (obj.get("spec") or {}).get("leaseDurationSeconds")
            if d is not None and d <= 0:
                raise invalid(
                    res,
                    name,
                    [("spec.leaseDurationSeconds", "Invalid", f"{d}: must be greater than 0")],
                )
        elif res.kind == "Event":
            inv = obj.get("involvedObject") or {}
            if inv.get("namespace") and inv["namespace"] != obj["metadata"].get("namespace"):
                raise invalid(
                    res,
                    name,
                    [
                        (
                            "involvedObject.namespace",
                            "Invalid",
                            f'"{inv["namespace"]}": does not match event.namespace',
                        )
                    ],
                )

    def _validate_update(self, res: Resource, old: Obj, new: Obj, subresource: str | None) -> None:
        name = old["metadata"]["name"]
        if subresource == "status":
            return
        if res is PODS:
            _validate_pod_update(res, name, old, new)
        elif res is JOBS:
            _validate_job_update(res, name, old, new)
        elif res is JOBSETS:
            _default_jobset(new)
            _validate_jobset_update(res, name, old, new)
        elif res is NODES:
            pass


# --- defaulting and validation helpers ----------------------------------------------


def _quantity(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    if float(value).is_integer():
        return str(int(value))
    return f"{round(value * 1000)}m"


def _default_pod_spec(spec: Obj) -> None:
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("priority", 0)
    for c in spec.get("containers") or []:
        res = c.get("resources") or {}
        # Quantities are strings in what the server answers, whatever JSON number was
        # sent ("8" for 8, "500m" for 0.5); the client's models take only strings.
        for part in ("limits", "requests"):
            if res.get(part):
                res[part] = {k: _quantity(v) for k, v in res[part].items()}
        limits = res.get("limits") or {}
        if limits:
            requests = res.setdefault("requests", {})
            for k, v in limits.items():
                requests.setdefault(k, v)
            c["resources"] = res
    # DefaultTolerationSeconds admission plugin.
    tolerations = spec.setdefault("tolerations", [])
    for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
        if not any(
            t.get("key") == key or (not t.get("key") and t.get("operator") == "Exists")
            for t in tolerations
        ):
            tolerations.append(
                {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}
            )


def _qos_class(spec: Obj) -> str:
    containers = spec.get("containers") or []
    reqs = [((c.get("resources") or {}).get("requests") or {}) for c in containers]
    lims = [((c.get("resources") or {}).get("limits") or {}) for c in containers]
    if not any(reqs) and not any(lims):
        return "BestEffort"
    guaranteed = all(
        all(k in lim and req.get(k) == lim.get(k) for k in ("cpu", "memory"))
        for req, lim in zip(reqs, lims, strict=True)
    )
    return "Guaranteed" if guaranteed else "Burstable"


def _default_job(job: Obj) -> None:
    spec = job.setdefault("spec", {})
    m = job["metadata"]
    if spec.get("completions") is None and spec.get("parallelism") is None:
        spec["completions"] = 1
        spec["parallelism"] = 1
    spec.setdefault("parallelism", 1)
    spec.setdefault("backoffLimit", 6)
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault("suspend", False)
    spec.setdefault(
        "podReplacementPolicy", "Failed" if spec.get("podFailurePolicy") else "TerminatingOrFailed"
    )
    template = spec.setdefault("template", {})
    tmeta = template.setdefault("metadata", {})
    labels = tmeta.setdefault("labels", {})
    if not spec.get("manualSelector"):
        uid = m["uid"]
        spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
        labels.update(
            {
                "batch.kubernetes.io/controller-uid": uid,
                "batch.kubernetes.io/job-name": m["name"],
                "controller-uid": uid,
                "job-name": m["name"],
            }
        )
    _default_pod_spec(template.setdefault("spec", {}))


def _default_jobset(js: Obj) -> None:
    """The JobSet mutating webhook (``jobSetWebhook.Default``) plus CRD defaults."""
    spec = js.setdefault("spec", {})
    spec.setdefault("successPolicy", {"operator": "All"})
    spec.setdefault("startupPolicy", {"startupPolicyOrder": "AnyOrder"})
    for rjob in spec.get("replicatedJobs") or []:
        rjob.setdefault("replicas", 1)
        jspec = rjob.setdefault("template", {}).setdefault("spec", {})
        jspec.setdefault("completionMode", "Indexed")
        network = spec.setdefault("network", {})
        network.setdefault("enableDNSHostnames", True)
        pspec = jspec.setdefault("template", {}).setdefault("spec", {})
        if not pspec.get("restartPolicy"):
            pspec["restartPolicy"] = "OnFailure"


_POD_MUTABLE_NOTE = (
    "pod updates may not change fields other than `spec.containers[*].image`,"
    "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` "
    "(only additions to existing tolerations),`spec.terminationGracePeriodSeconds` "
    "(allow it to be set to 1 if it was previously negative)"
)


def _validate_pod_update(res: Resource, name: str, old: Obj, new: Obj) -> None:
    def strip(spec: Obj) -> Obj:
        s: Obj = deep(spec or {})
        for key in ("containers", "initContainers"):
            for c in s.get(key) or []:
                c.pop("image", None)
        s.pop("activeDeadlineSeconds", None)
        s.pop("tolerations", None)
        s.pop("schedulingGates", None)
        return s

    ospec, nspec = old.get("spec") or {}, new.get("spec") or {}
    old_tol = ospec.get("tolerations") or []
    new_tol = nspec.get("tolerations") or []
    if strip(ospec) != strip(nspec) or any(t not in new_tol for t in old_tol):
        raise invalid(res, name, [("spec", "Forbidden", _POD_MUTABLE_NOTE)])


def _validate_job_update(res: Resource, name: str, old: Obj, new: Obj) -> None:
    ospec, nspec = old.get("spec") or {}, new.get("spec") or {}
    errors: list[tuple[str, str, str]] = []
    immutable = ["selector", "completionMode", "completions", "podFailurePolicy"]
    if not nspec.get("suspend") and not ospec.get("suspend"):
        immutable.append("template")
    for f in immutable:
        if ospec.get(f) != nspec.get(f):
            errors.append((f"spec.{f}", "Invalid", f"{_short(nspec.get(f))}: field is immutable"))
    if errors:
        raise invalid(res, name, errors)


def _validate_jobset_update(res: Resource, name: str, old: Obj, new: Obj) -> None:
    """CEL rules of the JobSet CRD (422), then the validating webhook (403).

    ``network``, ``successPolicy``, ``failurePolicy`` and ``startupPolicy`` carry
    ``x-kubernetes-validations: self == oldSelf`` ("Value is immutable"), checked by the
    API server: 422 Invalid. ``replicatedJobs`` (hence ``replicas``) and ``managedBy``
    are immutable through the validating webhook ``vjobset.kb.io``, which returns a
    plain error; controller-runtime turns that into ``admission.Denied``, i.e. code
    403, reason Forbidden. Pod template labels, annotations, nodeSelector,
    tolerations and schedulingGates may change while the JobSet is (or is being)
    suspended.
    """
    ospec, nspec = old.get("spec") or {}, new.get("spec") or {}
    cel_errors = [
        (f"spec.{f}", "Invalid", '"object": Value is immutable')
        for f in ("network", "successPolicy", "failurePolicy", "startupPolicy")
        if f in ospec and f in nspec and ospec[f] != nspec[f]
    ]
    if cel_errors:
        raise invalid(res, name, cel_errors)
    munged = deep(nspec.get("replicatedJobs") or [])
    if ospec.get("suspend") or nspec.get("suspend"):
        olds = ospec.get("replicatedJobs") or []
        for i, rjob in enumerate(munged):
            if i >= len(olds):
                break
            tmpl = rjob.get("template", {}).get("spec", {}).get("template", {})
            otmpl = olds[i].get("template", {}).get("spec", {}).get("template", {})
            tm, om = tmpl.setdefault("metadata", {}), otmpl.get("metadata", {})
            for k in ("labels", "annotations"):
                _copy_key(om, tm, k)
            ts, os_ = tmpl.setdefault("spec", {}), otmpl.get("spec", {})
            for k in ("nodeSelector", "tolerations", "schedulingGates"):
                _copy_key(os_, ts, k)
    problems = []
    if _normalise(munged) != _normalise(ospec.get("replicatedJobs") or []):
        problems.append(
            "spec.replicatedJobs: Invalid value: "
            f"{_short(nspec.get('replicatedJobs'))}: field is immutable"
        )
    if ospec.get("managedBy") != nspec.get("managedBy"):
        problems.append(
            f"spec.managedBy: Invalid value: {_short(nspec.get('managedBy'))}: field is immutable"
        )
    if problems:
        detail = problems[0] if len(problems) == 1 else "[" + ", ".join(problems) + "]"
        raise forbidden(f'admission webhook "vjobset.kb.io" denied the request: {detail}')


def _copy_key(src: Obj, dst: Obj, key: str) -> None:
    if key in src:
        dst[key] = deep(src[key])
    else:
        dst.pop(key, None)


def _normalise(value: Any) -> Any:
    """Drop empty maps so that {} and absent compare equal (as Go's DeepEqual on omitempty)."""
    if isinstance(value, dict):
        return {k: _normalise(v) for k, v in value.items() if v not in ({}, None)}
    if isinstance(value, list):
        return [_normalise(v) for v in value]
    return value


__all__ = ["ApiError", "ApiServer", "pod_ready", "random_suffix", "status_success", "with_type"]

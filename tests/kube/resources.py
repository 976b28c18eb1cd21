"""Resource table, Status errors and small helpers shared by the fake API server.

Every error the fake returns is a ``meta/v1 Status`` built the way
``k8s.io/apimachinery/pkg/api/errors`` builds it (same ``reason``, ``code``,
message format and ``details``), so that code parsing ``ApiException.body``
sees what a real kube-apiserver sends.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]

_COMMON_FIELDS = frozenset({"metadata.name", "metadata.namespace"})


@dataclass(frozen=True)
class Resource:
    """What the fake knows about one REST resource.

    ``field_selectors`` lists the field labels the real server accepts for
    that kind (``pkg/registry/<group>/<kind>/strategy.go`` ``*ToSelectableFields``);
    any other field in a fieldSelector is a 400 BadRequest, as on a real server.
    """

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    status_subresource: bool = False
    has_generation: bool = False
    custom: bool = False
    return_deleted_object: bool = False
    allow_unconditional_update: bool = True
    allow_create_on_update: bool = False
    field_selectors: frozenset[str] = field(default=_COMMON_FIELDS)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_resource(self) -> str:
        """``pods`` or ``jobs.batch``: how error messages name the resource."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def qualified_kind(self) -> str:
        """``Pod`` or ``JobSet.jobset.x-k8s.io``: how 422 Invalid names the kind."""
        return f"{self.kind}.{self.group}" if self.group else self.kind


PODS = Resource(
    "",
    "v1",
    "pods",
    "Pod",
    status_subresource=True,
    has_generation=True,
    return_deleted_object=True,
    field_selectors=_COMMON_FIELDS
    | {
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "spec.hostNetwork",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    },
)
NODES = Resource(
    "",
    "v1",
    "nodes",
    "Node",
    namespaced=False,
    status_subresource=True,
    field_selectors=_COMMON_FIELDS | {"spec.unschedulable"},
)
EVENTS = Resource(
    "",
    "v1",
    "events",
    "Event",
    allow_create_on_update=True,
    field_selectors=_COMMON_FIELDS
    | {
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
    },
)
LEASES = Resource("coordination.k8s.io", "v1", "leases", "Lease")
JOBS = Resource(
    "batch",
    "v1",
    "jobs",
    "Job",
    status_subresource=True,
    has_generation=True,
    field_selectors=_COMMON_FIELDS | {"status.successful"},
)
# A CRD with `subresources: {status: {}}` (the JobSet CRD has it). Custom resources
# refuse unconditional updates (PUT without metadata.resourceVersion).
JOBSETS = Resource(
    "jobset.x-k8s.io",
    "v1alpha2",
    "jobsets",
    "JobSet",
    status_subresource=True,
    has_generation=True,
    custom=True,
    allow_unconditional_update=False,
)

RESOURCES: tuple[Resource, ...] = (PODS, NODES, EVENTS, LEASES, JOBS, JOBSETS)
BY_PLURAL: dict[str, Resource] = {r.plural: r for r in RESOURCES}
BY_KIND: dict[str, Resource] = {r.kind: r for r in RESOURCES}
BY_PATH: dict[tuple[str, str, str], Resource] = {
    (r.group, r.version, r.plural): r for r in RESOURCES
}


def resolve(kind_or_plural: str) -> Resource:
    """``"pods"``, ``"Pod"`` or ``"pod"`` -> the Resource."""
    if kind_or_plural in BY_PLURAL:
        return BY_PLURAL[kind_or_plural]
    if kind_or_plural in BY_KIND:
        return BY_KIND[kind_or_plural]
    for r in RESOURCES:
        if kind_or_plural.lower() in (r.kind.lower(), r.plural.rstrip("s")):
            return r
    raise KeyError(f"unknown resource {kind_or_plural!r}")


# --- time -------------------------------------------------------------------


def now_rfc3339(offset_s: float = 0.0) -> str:
    """metav1.Time: RFC 3339 with second precision, UTC."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + offset_s))


def now_micro() -> str:
    """metav1.MicroTime: RFC 3339 with microseconds, UTC (Lease renewTime, Event eventTime)."""
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


# --- object helpers -----------------------------------------------------------


def meta(obj: Obj) -> Obj:
    m = obj.get("metadata")
    if not isinstance(m, dict):
        m = {}
        obj["metadata"] = m
    return m


def deep(obj: Any) -> Any:
    return copy.deepcopy(obj)


def get_path(obj: Any, path: str) -> Any:
    cur = obj
    for part in path.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def conditions(obj: Obj) -> list[Obj]:
    status = obj.get("status") or {}
    conds = status.get("conditions") or []
    return conds if isinstance(conds, list) else []


def condition(obj: Obj, ctype: str) -> Obj | None:
    for c in conditions(obj):
        if c.get("type") == ctype:
            return c
    return None


def condition_true(obj: Obj, ctype: str) -> bool:
    c = condition(obj, ctype)
    return c is not None and c.get("status") == "True"


def set_condition(obj: Obj, cond: Obj, *, time_field: str = "lastTransitionTime") -> bool:
    """Insert or update a condition by type; keep the transition time when the status holds.

    Returns True when anything changed (callers use it to avoid no-op writes).
    """
    status = obj.setdefault("status", {})
    conds: list[Obj] = status.setdefault("conditions", [])
    for i, c in enumerate(conds):
        if c.get("type") == cond["type"]:
            same = all(c.get(k) == v for k, v in cond.items() if k != time_field)
            if same:
                return False
            new = dict(cond)
            if c.get("status") == cond.get("status") and time_field in c:
                new[time_field] = c[time_field]
            else:
                new.setdefault(time_field, now_rfc3339())
            conds[i] = new
            return True
    new = dict(cond)
    new.setdefault(time_field, now_rfc3339())
    conds.append(new)
    return True


def owner_refs(obj: Obj) -> list[Obj]:
    refs = meta(obj).get("ownerReferences") or []
    return refs if isinstance(refs, list) else []


def controller_ref(obj: Obj) -> Obj | None:
    for ref in owner_refs(obj):
        if ref.get("controller"):
            return ref
    return None


def owner_ref_to(owner: Obj, res: Resource) -> Obj:
    m = owner["metadata"]
    return {
        "apiVersion": res.api_version,
        "kind": res.kind,
        "name": m["name"],
        "uid": m["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


# --- Status errors ------------------------------------------------------------


class ApiError(Exception):
    """An API error, rendered as a meta/v1 Status with the HTTP code."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        details: Obj | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.headers = headers or {}

    def status(self) -> Obj:
        s: Obj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            s["details"] = self.details
        return s


def _details(res: Resource, name: str, *, kind: str | None = None) -> Obj:
    d: Obj = {"name": name, "kind": kind or res.plural}
    if res.group:
        d["group"] = res.group
    return d


def not_found(res: Resource, name: str) -> ApiError:
    """errors.NewNotFound: 404, reason NotFound, `pods "x" not found`."""
    return ApiError(
        404, "NotFound", f'{res.group_resource} "{name}" not found', _details(res, name)
    )


def already_exists(res: Resource, name: str) -> ApiError:
    """errors.NewAlreadyExists: 409, reason AlreadyExists, `pods "x" already exists`."""
    return ApiError(
        409, "AlreadyExists", f'{res.group_resource} "{name}" already exists', _details(res, name)
    )


OBJECT_MODIFIED = (
    "the object has been modified; please apply your changes to the latest version and try again"
)


def conflict(res: Resource, name: str, why: str = OBJECT_MODIFIED) -> ApiError:
    """errors.NewConflict: 409, reason Conflict, `Operation cannot be fulfilled on ...`."""
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {res.group_resource} "{name}": {why}',
        _details(res, name),
    )


_FIELD_ERROR_TYPES = {
    "Invalid": "Invalid value",
    "Forbidden": "Forbidden",
    "Required": "Required value",
    "NotSupported": "Unsupported value",
}


def invalid(res: Resource, name: str, errors: list[tuple[str, str, str]]) -> ApiError:
    """errors.NewInvalid: 422, reason Invalid, one cause per field error.

    ``errors`` holds (field, type, detail), type one of Invalid / Forbidden /
    Required / NotSupported, rendered as ``field.Error.Error()`` does:
    ``spec.x: Invalid value: "v": field is immutable``.
    """
    rendered = [f"{f}: {_FIELD_ERROR_TYPES[t]}: {d}" for f, t, d in errors]
    msg = rendered[0] if len(rendered) == 1 else "[" + ", ".join(rendered) + "]"
    causes = [
        {"reason": f"FieldValue{t}", "message": f"{_FIELD_ERROR_TYPES[t]}: {d}", "field": f}
        for f, t, d in errors
    ]
    details = _details(res, name, kind=res.kind)
    details["causes"] = causes
    return ApiError(422, "Invalid", f'{res.qualified_kind} "{name}" is invalid: {msg}', details)


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def forbidden(message: str, res: Resource | None = None, name: str = "") -> ApiError:
    return ApiError(403, "Forbidden", message, _details(res, name) if res else None)


def too_many_requests(message: str, retry_after: int, causes: list[Obj] | None = None) -> ApiError:
    """errors.NewTooManyRequests: 429, details.retryAfterSeconds, Retry-After header."""
    details: Obj = {"retryAfterSeconds": retry_after} if retry_after else {}
    if causes:
        details["causes"] = causes
    headers = {"Retry-After": str(retry_after)} if retry_after else {}
    return ApiError(429, "TooManyRequests", message, details, headers)


def expired(message: str) -> ApiError:
    """410 Gone, reason Expired (errors.NewResourceExpired)."""
    return ApiError(410, "Expired", message)


def unsupported_media_type(message: str) -> ApiError:
    return ApiError(415, "UnsupportedMediaType", message)

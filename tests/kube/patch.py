"""The three patch formats the real API server accepts on PATCH.

- ``application/merge-patch+json``: RFC 7386 JSON merge patch. ``null`` deletes a key,
  objects merge recursively, anything else (lists included) replaces.
- ``application/strategic-merge-patch+json``: like merge patch, except lists that the
  Go types mark ``patchStrategy:"merge"`` merge element-wise by their
  ``patchMergeKey`` (pod and node ``status.conditions`` by ``type``,
  ``metadata.ownerReferences`` by ``uid``, containers by ``name``...), primitive
  merge lists (``metadata.finalizers``) merge as a set, and the ``$patch``,
  ``$retainKeys``, ``$deleteFromPrimitiveList/<f>`` and ``$setElementOrder/<f>``
  directives apply. Lists without a patch strategy are atomic and are replaced: that
  includes ``spec.taints`` of a Node (``+listType=atomic`` in k8s.io/api core/v1) and
  ``spec.tolerations`` of a Pod. Custom resources do not support it: 415.
- ``application/json-patch+json``: RFC 6902 (add, remove, replace, move, copy, test).
"""

from __future__ import annotations

import copy
from typing import Any

from .resources import ApiError, Obj, bad_request

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"

PRIMITIVE_MERGE = "<primitive>"

_POD_SPEC_LISTS: dict[tuple[str, ...], str] = {
    ("containers",): "name",
    ("initContainers",): "name",
    ("ephemeralContainers",): "name",
    ("containers", "env"): "name",
    ("initContainers", "env"): "name",
    ("containers", "ports"): "containerPort",
    ("initContainers", "ports"): "containerPort",
    ("containers", "volumeMounts"): "mountPath",
    ("initContainers", "volumeMounts"): "mountPath",
    ("volumes",): "name",
    ("imagePullSecrets",): "name",
    ("schedulingGates",): "name",
}


def _pod_spec_at(prefix: tuple[str, ...]) -> dict[tuple[str, ...], str]:
    return {prefix + k: v for k, v in _POD_SPEC_LISTS.items()}


_META_LISTS: dict[tuple[str, ...], str] = {
    ("metadata", "ownerReferences"): "uid",
    ("metadata", "finalizers"): PRIMITIVE_MERGE,
}

# Patch merge keys per resource plural, from the Go struct tags of k8s.io/api.
MERGE_KEYS: dict[str, dict[tuple[str, ...], str]] = {
    "pods": {
        **_META_LISTS,
        **_pod_spec_at(("spec",)),
        ("status", "conditions"): "type",
        ("status", "podIPs"): "ip",
    },
    "nodes": {
        **_META_LISTS,
        ("spec", "podCIDRs"): PRIMITIVE_MERGE,
        ("status", "conditions"): "type",
        ("status", "addresses"): "type",
    },
    "jobs": {
        **_META_LISTS,
        **_pod_spec_at(("spec", "template", "spec")),
        ("status", "conditions"): "type",
    },
    "events": dict(_META_LISTS),
    "leases": dict(_META_LISTS),
}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 MergePatch(Target, Patch)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            result.pop(k, None)
        else:
            result[k] = merge_patch(result.get(k), v)
    return result


def strategic_merge_patch(target: Any, patch: Any, plural: str) -> Any:
    if not isinstance(patch, dict):
        raise bad_request("strategic merge patch must be a JSON object")
    return _smp_map(
        target if isinstance(target, dict) else {}, patch, (), MERGE_KEYS.get(plural, {})
    )


def _smp_map(
    target: dict[str, Any],
    patch: dict[str, Any],
    path: tuple[str, ...],
    keys: dict[tuple[str, ...], str],
) -> dict[str, Any] | None:
    directive = patch.get("$patch")
    if directive == "delete":
        return None
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result = copy.deepcopy(target)
    retain = patch.get("$retainKeys")
    for k, v in patch.items():
        if k in ("$patch", "$retainKeys") or k.startswith("$setElementOrder/"):
            continue
        if k.startswith("$deleteFromPrimitiveList/"):
            name = k.split("/", 1)[1]
            cur = result.get(name)
            if isinstance(cur, list):
                result[name] = [x for x in cur if x not in (v or [])]
            continue
        if v is None:
            result.pop(k, None)
            continue
        sub = (*path, k)
        cur = result.get(k)
        if isinstance(v, dict):
            merged = _smp_map(cur if isinstance(cur, dict) else {}, v, sub, keys)
            if merged is None:
                result.pop(k, None)
            else:
                result[k] = merged
        elif isinstance(v, list) and sub in keys:
            result[k] = _smp_list(cur if isinstance(cur, list) else [], v, sub, keys)
        else:
            result[k] = copy.deepcopy(v)
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _smp_list(
    target: list[Any], patch: list[Any], path: tuple[str, ...], keys: dict[tuple[str, ...], str]
) -> list[Any]:
    key = keys[path]
    if key == PRIMITIVE_MERGE:
        out = list(target)
        for v in patch:
            if v not in out:
                out.append(copy.deepcopy(v))
        return out
    if any(isinstance(p, dict) and p.get("$patch") == "replace" for p in patch):
        return [copy.deepcopy(p) for p in patch if not (isinstance(p, dict) and "$patch" in p)]
    out = [copy.deepcopy(t) for t in target]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise bad_request(f"map: {item!r} does not contain declared merge key: {key}")
        idx = next(
            (i for i, t in enumerate(out) if isinstance(t, dict) and t.get(key) == item[key]), None
        )
        if item.get("$patch") == "delete":
            if idx is not None:
                out.pop(idx)
            continue
        if idx is None:
            merged = _smp_map({}, item, path, keys)
            if merged is not None:
                out.append(merged)
        else:
            merged = _smp_map(out[idx], item, path, keys)
            if merged is None:
                out.pop(idx)
            else:
                out[idx] = merged
    return out


# --- RFC 6902 -----------------------------------------------------------------


class JsonPatchError(Exception):
    pass


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise JsonPatchError(f"JSON pointer {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _index(container: list[Any], token: str, *, allow_end: bool) -> int:
    if token == "-" and allow_end:
        return len(container)
    if not token.isdigit():
        raise JsonPatchError(f"invalid array index {token!r}")
    i = int(token)
    if i > len(container) or (i == len(container) and not allow_end):
        raise JsonPatchError(f"array index {i} out of bounds")
    return i


def _parent(doc: Any, tokens: list[str]) -> Any:
    cur = doc
    for t in tokens[:-1]:
        if isinstance(cur, dict):
            if t not in cur:
                raise JsonPatchError(f"missing path component {t!r}")
            cur = cur[t]
        elif isinstance(cur, list):
            cur = cur[_index(cur, t, allow_end=False)]
        else:
            raise JsonPatchError(f"cannot traverse into {t!r}")
    return cur


def _get(doc: Any, path: str) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return doc
    parent = _parent(doc, tokens)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise JsonPatchError(f"missing value at {path!r}")
        return parent[last]
    if isinstance(parent, list):
        return parent[_index(parent, last, allow_end=False)]
    raise JsonPatchError(f"no value at {path!r}")


def _add(doc: Any, path: str, value: Any) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return value
    parent = _parent(doc, tokens)
    last = tokens[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, allow_end=True), value)
    else:
        raise JsonPatchError(f"cannot add at {path!r}")
    return doc


def _remove(doc: Any, path: str) -> Any:
    tokens = _pointer(path)
    if not tokens:
        raise JsonPatchError("cannot remove the whole document")
    parent = _parent(doc, tokens)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise JsonPatchError(f"unable to remove nonexistent key: {last}: missing value")
        del parent[last]
    elif isinstance(parent, list):
        parent.pop(_index(parent, last, allow_end=False))
    else:
        raise JsonPatchError(f"cannot remove at {path!r}")
    return doc


def json_patch(doc: Any, ops: Any) -> Any:
    """Apply RFC 6902 operations. A malformed document raises ApiError 400; an
    operation that cannot apply (missing path, failed test) raises JsonPatchError."""
    if not isinstance(ops, list):
        raise bad_request("json patch must be a JSON array of operations")
    doc = copy.deepcopy(doc)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise bad_request(f"invalid JSON patch operation: {op!r}")
        kind, path = op["op"], op["path"]
        if kind in ("add", "replace", "test") and "value" not in op:
            raise bad_request(f"JSON patch operation {kind!r} needs a value")
        if kind == "add":
            doc = _add(doc, path, copy.deepcopy(op["value"]))
        elif kind == "remove":
            doc = _remove(doc, path)
        elif kind == "replace":
            _get(doc, path)
            doc = (
                _add(_remove(doc, path), path, copy.deepcopy(op["value"])) if path else op["value"]
            )
        elif kind in ("move", "copy"):
            if "from" not in op:
                raise bad_request(f"JSON patch operation {kind!r} needs 'from'")
            value = copy.deepcopy(_get(doc, op["from"]))
            if kind == "move":
                doc = _remove(doc, op["from"])
            doc = _add(doc, path, value)
        elif kind == "test":
            if _get(doc, path) != op["value"]:
                raise JsonPatchError(f"testing value {path} failed: test failed")
        else:
            raise bad_request(f"Unexpected kind: {kind}")
    return doc


def apply_patch(content_type: str, current: Obj, body: Any, plural: str, custom: bool) -> Obj:
    """Apply a PATCH body to ``current``; errors as the real server reports them."""
    ct = content_type.split(";")[0].strip().lower()
    if ct == MERGE_PATCH:
        if not isinstance(body, dict):
            raise bad_request("merge patch must be a JSON object")
        result = merge_patch(current, body)
    elif ct == STRATEGIC_MERGE_PATCH:
        if custom:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                "the body of the request was in an unknown format - accepted media types "
                "include: application/json-patch+json, application/merge-patch+json, "
                "application/apply-patch+yaml",
            )
        result = strategic_merge_patch(current, body, plural)
    elif ct == JSON_PATCH:
        try:
            result = json_patch(current, body)
        except JsonPatchError as e:
            raise ApiError(422, "Invalid", str(e)) from e
    elif ct == APPLY_PATCH:
        raise ApiError(
            415, "UnsupportedMediaType", "server-side apply is not implemented by the fake"
        )
    else:
        raise ApiError(
            415,
            "UnsupportedMediaType",
            f"the body of the request was in an unknown format - accepted media types include: "
            f"{JSON_PATCH}, {MERGE_PATCH}, {STRATEGIC_MERGE_PATCH}, {APPLY_PATCH}",
        )
    if not isinstance(result, dict):
        raise bad_request("patch result is not an object")
    return result

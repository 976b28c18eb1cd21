"""Reading and writing the objects actions are about (JobSets, Nodes): read, patch,
read-modify-write conditional on the resourceVersion read, the journal entry of an action
planned and finished on its object, and the Event that tells people what was done."""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable, Mapping
from typing import Any

from supervisor.actuator.backend import ActionError
from supervisor.domain import ActionRecord
from supervisor.kube import objects as o
from supervisor.kube.action_context import ActionContext
from supervisor.kube.errors import Conflict, NotFound
from supervisor.kube.journal import JournalEntry, journal_of, set_journal
from supervisor.kube.objects import Obj

#: Attempts at a read-modify-write that keeps hitting 409 Conflict.
CONFLICT_ATTEMPTS = 8


def merge_patch(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) that turns `old` into `new` (dicts only at the top)."""
    patch: Obj = {}
    for key in old.keys() | new.keys():
        if key not in new:
            patch[key] = None
        elif key not in old:
            patch[key] = new[key]
        elif isinstance(old[key], dict) and isinstance(new[key], dict):
            if sub := merge_patch(old[key], new[key]):
                patch[key] = sub
        elif old[key] != new[key]:
            patch[key] = new[key]
    return patch


async def read(ctx: ActionContext, kind: str, name: str) -> Obj:
    if kind == "Node":
        response = await ctx.calls.run(
            f"get node {name}", ctx.core.read_node, name, _preload_content=False
        )
    else:
        response = await ctx.calls.run(
            f"get jobset {name}",
            ctx.custom.get_namespaced_custom_object,
            o.JOBSET_GROUP,
            o.JOBSET_VERSION,
            ctx.ns,
            o.JOBSET_PLURAL,
            name,
            _preload_content=False,
        )
    obj: Obj = json.loads(response.data)
    return obj


async def patch(ctx: ActionContext, kind: str, name: str, body: Obj) -> Obj:
    """Patch (merge patch on the JobSet; on the Node the client sends a strategic merge
    patch, which for labels, annotations, `unschedulable` and the atomic `taints`
    list means the same). `metadata.resourceVersion` in the patch is a precondition:
    409 Conflict if the object changed since it was read."""
    if kind == "Node":
        response = await ctx.calls.run(
            f"patch node {name}", ctx.core.patch_node, name, body, _preload_content=False
        )
    else:
        response = await ctx.calls.run(
            f"patch jobset {name}",
            ctx.custom.patch_namespaced_custom_object,
            o.JOBSET_GROUP,
            o.JOBSET_VERSION,
            ctx.ns,
            o.JOBSET_PLURAL,
            name,
            body,
            _preload_content=False,
        )
    written: Obj = json.loads(response.data)
    return written


async def modify(ctx: ActionContext, kind: str, name: str, change: Callable[[Obj], bool]) -> Obj:
    """Read, `change` a copy in place (returns whether it changed anything), send the
    difference as a patch conditional on the resourceVersion read; again on 409."""
    for _ in range(CONFLICT_ATTEMPTS):
        obj = await read(ctx, kind, name)
        changed = copy.deepcopy(obj)
        if not change(changed):
            return obj
        difference = merge_patch(obj, changed)
        if not difference:
            return obj
        difference.setdefault("metadata", {})["resourceVersion"] = o.meta(obj)["resourceVersion"]
        try:
            return await patch(ctx, kind, name, difference)
        except Conflict:
            continue
    raise ActionError(f"{kind} {name} kept changing under us (409 Conflict)", retryable=True)


async def plan(
    ctx: ActionContext,
    kind: str,
    name: str,
    key: str,
    decide: Callable[[Obj], JournalEntry],
    also: Callable[[Obj], bool] | None = None,
) -> tuple[Obj, JournalEntry]:
    """The journal entry of `key` on the object: the existing one, or `decide(obj)`,
    written together with whatever `also` changes on the object."""

    def change(obj: Obj) -> bool:
        changed = also(obj) if also is not None else False
        journal = journal_of(obj)
        if key not in journal:
            journal[key] = decide(obj)
            set_journal(obj, journal)
            changed = True
        return changed

    obj = await modify(ctx, kind, name, change)
    return obj, journal_of(obj)[key]


async def finish(
    ctx: ActionContext, kind: str, name: str, key: str, result: Mapping[str, Any]
) -> None:
    def change(obj: Obj) -> bool:
        journal = journal_of(obj)
        entry = journal.get(key) or JournalEntry()
        if entry.done:
            return False
        journal[key] = entry.finished(result)
        set_journal(obj, journal)
        return True

    # NotFound: e.g. the JobSet was deleted meanwhile; nothing left to remember it on.
    with contextlib.suppress(NotFound):
        await modify(ctx, kind, name, change)


async def event(
    ctx: ActionContext,
    obj: Obj,
    kind: str,
    action: ActionRecord,
    reason: str,
    what: str,
    *,
    warning: bool = False,
    annotations: dict[str, str] | None = None,
) -> bool:
    api_version = {"Node": "v1", "Pod": "v1", "JobSet": o.JOBSET_API_VERSION}[kind]
    message = f"{what} (supervisor action {action.id}: {action.reason or action.type.value})"
    return await ctx.events.record(
        obj,
        kind=kind,
        api_version=api_version,
        key=action.idempotency_key,
        reason=reason,
        message=message,
        warning=warning,
        annotations=annotations,
    )


def repeated(entry: JournalEntry) -> dict[str, Any]:
    """The answer to an action whose entry says it is done: its result again."""
    return {"repeated": True, **(entry.result or {})}

"""`scale_down` and `scale_up`: the JobSet recreated with another number of data-parallel
replicas (a JobSet's replicatedJobs are immutable).

The new body is decided once and kept where it outlives each step: in an annotation of
the old JobSet (with the action's key) before it is deleted, on an Event recorded then
(the only copy left if the supervisor dies between the deletion and the creation), and in
memory. The old JobSet is deleted in the foreground, the new one created once its pods
are gone; its journal, carried over, marks the action done.
"""

from __future__ import annotations

import contextlib
import copy
import json
from functools import partial
from typing import Any

from kubernetes import client

from supervisor.action_params import ScaleDownParams, ScaleUpParams
from supervisor.actuator.backend import ActionError, checked_params
from supervisor.domain import ActionRecord, ActionType
from supervisor.kube import objects as o
from supervisor.kube import rmw
from supervisor.kube.action_context import ActionContext, jobset_name
from supervisor.kube.errors import Conflict, NotFound
from supervisor.kube.events import event_name
from supervisor.kube.eviction import delete_now, node_up
from supervisor.kube.journal import (
    JournalEntry,
    Target,
    entry_of,
    journal_of,
    set_journal,
    target_of,
)
from supervisor.kube.node_fencing import may_force_delete
from supervisor.kube.nodes import swap_out_node
from supervisor.kube.objects import Obj

#: Reason of the Event recorded before a JobSet is deleted to be recreated.
RESCALING = "Rescaling"


class Rescaling:
    def __init__(self, ctx: ActionContext) -> None:
        self.ctx = ctx
        # Bodies of JobSets being recreated, by action key: a copy of what is also kept
        # in the old JobSet's annotation while it is being deleted.
        self._recreating: dict[str, Obj] = {}

    async def scale(self, action: ActionRecord) -> dict[str, Any]:
        ctx = self.ctx
        jobset, key = jobset_name(action), action.idempotency_key
        params = checked_params(action)
        if not isinstance(params, ScaleDownParams | ScaleUpParams):
            raise ActionError(f"{action.type.value} is not a scale action")
        to = params.to_replicas
        try:
            js: Obj | None = await rmw.read(ctx, "JobSet", jobset)
        except NotFound:
            js = None
        body = self._recreating.get(key)
        if js is not None and not o.terminating(js):
            entry = entry_of(js, key)
            if entry is not None and entry.done:
                return rmw.repeated(entry)
            shape = ctx.discovery.shape(js)
            low, high = shape.min_num_dp_replicas, shape.max_num_dp_replicas
            if not low <= to <= high:
                raise ActionError(f"to_replicas={to} outside [{low}, {high}] for {jobset}")
            exclude = params.exclude_node if isinstance(params, ScaleDownParams) else None
            if exclude:
                # Keep the new pods off the bad node until it has recovered.
                await rmw.modify(ctx, "Node", exclude, partial(swap_out_node, ctx.settings))
            pending = o.annotations_of(js).get(o.RECREATE)
            if pending and json.loads(pending).get("key") == key:
                body = json.loads(pending)["body"]
            else:
                body = rescaled(ctx, js, to, action)
                note = json.dumps({"key": key, "body": body}, sort_keys=True)

                def mark(obj: Obj) -> bool:
                    o.meta(obj).setdefault("annotations", {})[o.RECREATE] = note
                    return True

                js = await rmw.modify(ctx, "JobSet", jobset, mark)
            self._recreating[key] = body
            # The new body rides on this Event too: the only copy that outlives the old
            # JobSet if the supervisor dies between the deletion and the creation.
            await rmw.event(
                ctx,
                js,
                "JobSet",
                action,
                RESCALING,
                f"recreating {jobset} with {to} data-parallel replicas"
                f" (was {shape.num_dp_replicas})",
                annotations={o.RECREATE: json.dumps({"key": key, "body": body})},
            )
            options = client.V1DeleteOptions(
                propagation_policy="Foreground",
                preconditions=client.V1Preconditions(uid=o.uid_of(js)),
            )
            with contextlib.suppress(NotFound, Conflict):
                await ctx.calls.run(
                    f"delete jobset {jobset}",
                    ctx.custom.delete_namespaced_custom_object,
                    o.JOBSET_GROUP,
                    o.JOBSET_VERSION,
                    ctx.ns,
                    o.JOBSET_PLURAL,
                    jobset,
                    body=options,
                )
        elif js is not None:  # being deleted: by this action before a crash, or by someone
            pending = o.annotations_of(js).get(o.RECREATE)
            if pending and json.loads(pending).get("key") == key:
                body = json.loads(pending)["body"]
                self._recreating[key] = body
        if body is None:
            body = await body_from_event(ctx, jobset, key)
        if body is None:
            raise ActionError(
                f"JobSet {jobset} is gone or being deleted by someone else; nothing to recreate"
            )
        old_uid = o.uid_of(js) if js is not None else None

        def old_gone() -> bool:
            current = ctx.discovery.jobset(jobset)
            if current is not None and o.uid_of(current) == old_uid:
                return False
            return not [p for p in ctx.discovery.pods_of(jobset) if not o.pod_finished(p)]

        waiting = await release_pods_of_down_nodes(ctx, action, jobset)
        limit = ctx.settings.pod_termination_threshold_s
        if not await ctx.discovery.wait_until(old_gone, limit):
            left = sorted(o.name_of(p) for p in ctx.discovery.pods_of(jobset))
            why = "".join(f"; pods of {node}: {reason}" for node, reason in waiting.items())
            raise ActionError(
                f"old pods of {jobset} still there after pod_termination_threshold_s="
                f"{limit:g}s: {left}{why}",
                retryable=True,
            )
        try:
            response = await ctx.calls.run(
                f"create jobset {jobset}",
                ctx.custom.create_namespaced_custom_object,
                o.JOBSET_GROUP,
                o.JOBSET_VERSION,
                ctx.ns,
                o.JOBSET_PLURAL,
                body,
                _preload_content=False,
            )
            created: Obj = json.loads(response.data)
        except Conflict:
            created = await rmw.read(ctx, "JobSet", jobset)
            entry = entry_of(created, key)
            if entry is None or not entry.done:
                raise ActionError(
                    f"JobSet {jobset} exists again but not from this action", retryable=True
                ) from None
        self._recreating.pop(key, None)
        result = dict(journal_of(body)[key].result or {})
        await rmw.event(
            ctx,
            created,
            "JobSet",
            action,
            "ScaleDown" if action.type is ActionType.SCALE_DOWN else "ScaleUp",
            f"recreated with {to} data-parallel replicas",
        )
        return result


def rescaled(ctx: ActionContext, js: Obj, to: int, action: ActionRecord) -> Obj:
    """The new JobSet: the original spec with `to` data-parallel replicas (the original
    itself when `to` is its replica count), our annotations, the journal carried over."""
    shape = ctx.discovery.shape(js)
    annotations = o.annotations_of(js)
    annotations.pop(o.RECREATE, None)
    if o.ORIGINAL_SPEC in annotations:
        original = json.loads(annotations[o.ORIGINAL_SPEC])
    else:
        original = copy.deepcopy(js.get("spec", {}))
    spec = copy.deepcopy(original)
    if to == shape.original_replicas:
        annotations.pop(o.ORIGINAL_SPEC, None)
        annotations.pop(o.NUM_DP_REPLICAS, None)
    else:
        annotations[o.ORIGINAL_SPEC] = json.dumps(original, sort_keys=True)
        annotations[o.NUM_DP_REPLICAS] = str(to)
        rjob = o.dp_replicated_job({"metadata": js.get("metadata", {}), "spec": spec})
        assert rjob is not None
        for target in spec["replicatedJobs"]:
            if target.get("name") != rjob.get("name"):
                continue
            target["replicas"] = to
            pod_spec = target.setdefault("template", {}).setdefault("spec", {})
            pod_spec = pod_spec.setdefault("template", {}).setdefault("spec", {})
            env = {
                o.ENV_NUM_DP_REPLICAS: str(to),
                o.ENV_NNODES: str(to * shape.num_nodes_per_dp),
            }
            for container in pod_spec.get("containers") or []:
                kept = [e for e in container.get("env") or [] if e.get("name") not in env]
                container["env"] = kept + [{"name": k, "value": v} for k, v in env.items()]
    m = js.get("metadata", {})
    body: Obj = {
        "apiVersion": o.JOBSET_API_VERSION,
        "kind": "JobSet",
        "metadata": {
            "name": m.get("name"),
            "namespace": m.get("namespace", ctx.ns),
            "labels": dict(m.get("labels") or {}),
            "annotations": annotations,
        },
        "spec": spec,
    }
    if m.get("ownerReferences"):
        body["metadata"]["ownerReferences"] = m["ownerReferences"]
    journal = journal_of(js)
    journal[action.idempotency_key] = JournalEntry(
        type=action.type.value,
        done=True,
        result={"num_dp_replicas": to, "from_replicas": shape.num_dp_replicas},
    )
    set_journal(body, journal)
    return body


async def release_pods_of_down_nodes(
    ctx: ActionContext, action: ActionRecord, jobset: str
) -> dict[str, str]:
    """The old JobSet's pods on a node that is down never end by themselves (no kubelet
    confirms it): deleted with grace 0 where node_fencing allows; node -> why not,
    for the others."""
    by_node: dict[str, list[Target]] = {}
    for pod in ctx.discovery.pods_of(jobset):
        node = o.node_of(pod)
        if node and not o.pod_finished(pod) and not node_up(ctx, node):
            by_node.setdefault(node, []).append(target_of(pod))
    waiting = {}
    for node, targets in sorted(by_node.items()):
        verdict = may_force_delete(ctx.settings, node, ctx.discovery.node(node))
        if verdict.allowed:
            await delete_now(ctx, action, targets)
        else:
            waiting[node] = verdict.why
    return waiting


async def body_from_event(ctx: ActionContext, jobset: str, key: str) -> Obj | None:
    name = event_name("JobSet", jobset, key, RESCALING)
    annotations = await ctx.events.annotations(ctx.ns, name)
    note = (annotations or {}).get(o.RECREATE)
    if not note:
        return None
    body: Obj = json.loads(note)["body"]
    return body

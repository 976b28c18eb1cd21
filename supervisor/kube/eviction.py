"""Pods: eviction, with delete as the fallback, and the forced delete of a pod.

Eviction (policy/v1) honours PodDisruptionBudgets and marks the pod DisruptionTarget, the
condition the Jobs' pod failure policies match on. Every request carries the pod's UID as
precondition: a pod replaced meanwhile is left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from kubernetes import client

from resiliency_protocol.backoff import Backoff
from supervisor.action_params import ForceDeletePodParams
from supervisor.actuator.backend import ActionError, params_for
from supervisor.domain import ActionRecord
from supervisor.kube import objects as o
from supervisor.kube import rmw
from supervisor.kube.action_context import ActionContext
from supervisor.kube.errors import ApiError, Conflict, NotFound, TooManyRequests
from supervisor.kube.journal import Target, target_of
from supervisor.kube.node_fencing import may_force_delete

log = logging.getLogger(__name__)

#: A pod in one of these phases has ended: nothing is left to mark.
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


async def evict(ctx: ActionContext, name: str, uid: str) -> str:
    """Evict one pod (policy/v1, honours PDBs, marks DisruptionTarget); when eviction is
    impossible (a PDB refusing, 429, for `eviction_patience_s`; 500 with several PDBs),
    delete it with `pod_deletion_grace_period_s`. A 403 (RBAC, or an admission webhook,
    refusing the eviction) is raised, never got around by a delete. UID preconditions: a
    pod that was replaced meanwhile is left alone. Returns what happened."""
    body = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": ctx.ns},
        "deleteOptions": {"preconditions": {"uid": uid}},
    }
    deadline = time.monotonic() + ctx.eviction_patience_s
    backoff = Backoff(*ctx.calls.backoff_s)
    while True:
        try:
            await ctx.calls.run(
                f"evict pod {name}",
                ctx.core.create_namespaced_pod_eviction,
                name,
                ctx.ns,
                body,
                retry_429=False,
            )
            return "evicted"
        except (NotFound, Conflict):
            return "gone"
        except TooManyRequests as exc:
            # A PDB refuses for now; it may allow it once another pod is back.
            why = str(exc)
            if time.monotonic() + backoff.peek() > deadline:
                break
            await asyncio.sleep(backoff.next())
        except ApiError as exc:
            # 500: the pod is covered by more than one PDB, which eviction does not
            # support. Other transient statuses (and no answer at all): the API
            # server is unreachable or overloaded; the action is retried.
            if exc.status == 403 or (exc.retryable and exc.status != 500):
                raise
            why = str(exc)
            break
    log.warning("eviction of %s impossible (%s); deleting it instead", name, why)
    options = client.V1DeleteOptions(
        grace_period_seconds=ctx.settings.pod_deletion_grace_period_s,
        preconditions=client.V1Preconditions(uid=uid),
    )
    try:
        await ctx.calls.run(
            f"delete pod {name}", ctx.core.delete_namespaced_pod, name, ctx.ns, body=options
        )
    except (NotFound, Conflict):
        return "gone"
    return "deleted"


async def evict_targets(
    ctx: ActionContext, action: ActionRecord, targets: Sequence[Target], reason: str, what: str
) -> dict[str, str]:
    """Evict the pods together: one eviction_patience_s for all, not one each."""

    async def one(name: str, uid: str) -> str:
        pod = ctx.discovery.informers["Pod"].items.get(f"{ctx.ns}/{name}")
        outcome = await evict(ctx, name, uid)
        if pod is not None and outcome != "gone":
            await rmw.event(ctx, pod, "Pod", action, reason, f"{what}: {outcome}")
        return outcome

    results = await asyncio.gather(*(one(name, uid) for name, uid in targets))
    return {name: result for (name, _), result in zip(targets, results, strict=True)}


def running_pods(ctx: ActionContext, jobset: str, node: str | None) -> list[Target]:
    return sorted(
        target_of(p)
        for p in ctx.discovery.pods_of(jobset)
        if (node is None or o.node_of(p) == node) and not o.terminating(p) and not o.pod_finished(p)
    )


async def _node_now(ctx: ActionContext, name: str) -> o.Obj | None:
    """The node as the API server has it now, not as the watch last saw it: a grace-0
    delete decided on a stale copy would miss a taint just added, or one just removed."""
    try:
        return await rmw.read(ctx, "Node", name)
    except NotFound:
        return None


async def force_delete_pod(ctx: ActionContext, action: ActionRecord) -> dict[str, Any]:
    params = params_for(action, ForceDeletePodParams)
    pod_name, ns, uid = params.pod, params.namespace or ctx.ns, params.uid
    cached = ctx.discovery.informers["Pod"].items.get(f"{ns}/{pod_name}")
    if cached is None or (uid and o.uid_of(cached) != uid):
        return {"pod": pod_name, "outcome": "gone"}
    node = o.node_of(cached)
    verdict = may_force_delete(ctx.settings, node, await _node_now(ctx, node) if node else None)
    if not verdict.allowed:
        # Not retried: it stays so until the node is back or fenced (node_fencing.py).
        raise ActionError(f"pod {pod_name} not deleted with grace 0: {verdict.why}")
    options = client.V1DeleteOptions(
        grace_period_seconds=0,
        preconditions=client.V1Preconditions(uid=uid) if uid else None,
    )
    try:
        if cached.get("status", {}).get("phase") not in TERMINAL_PHASES:
            await mark_failed(ctx, pod_name, ns, action)
        await ctx.calls.run(
            f"force delete pod {pod_name}",
            ctx.core.delete_namespaced_pod,
            pod_name,
            ns,
            body=options,
        )
    except (NotFound, Conflict):
        return {"pod": pod_name, "outcome": "gone"}
    js = ctx.discovery.jobset(action.job) if action.job else None
    if js is not None:
        await rmw.event(
            ctx,
            js,
            "JobSet",
            action,
            "ForceDeletePod",
            f"pod {pod_name} deleted with grace period 0",
        )
    return {"pod": pod_name, "outcome": "deleted"}


async def mark_failed(ctx: ActionContext, pod_name: str, ns: str, action: ActionRecord) -> None:
    """Mark a pod whose kubelet is gone Failed, with DisruptionTarget, as the pod garbage
    collector marks the pods it deletes. A Job with a pod failure policy (every JobSet
    of "JobSet requirements") counts a pod only once it is Failed, and keeps its tracking
    finalizer on it until then: without this, the pod deleted with grace 0 stays, and
    the Job neither fails nor replaces it (seen on the real API server)."""
    condition = {
        "type": "DisruptionTarget",
        "status": "True",
        "reason": "DeletionByResiliencySupervisor",
        "message": f"supervisor action {action.id}: {action.reason}",
        "lastTransitionTime": o.rfc3339(),
    }
    await ctx.calls.run(
        f"mark pod {pod_name} failed",
        ctx.core.patch_namespaced_pod_status,
        pod_name,
        ns,
        {"status": {"phase": "Failed", "conditions": [condition]}},
        _preload_content=False,
    )


def node_up(ctx: ActionContext, node: str) -> bool:
    """Whether the node's kubelet can end its pods: Ready, and its host monitor not silent."""
    obj = ctx.discovery.node(node)
    heartbeating = ctx.hooks.node_heartbeating(node) if ctx.hooks is not None else None
    return obj is not None and o.node_ready(obj) and heartbeating is not False


async def delete_now(ctx: ActionContext, action: ActionRecord, targets: Sequence[Target]) -> None:
    """Delete pods of a node that is down (grace 0): no kubelet will ever confirm their
    graceful end. Each is marked Failed first (`mark_failed`): its Job, which stays,
    replaces it only then. Only where node_fencing.may_force_delete allows it."""
    for name, uid in targets:
        cached = ctx.discovery.informers["Pod"].items.get(f"{ctx.ns}/{name}")
        options = client.V1DeleteOptions(
            grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid)
        )
        with contextlib.suppress(NotFound, Conflict):
            if (
                cached is not None
                and o.uid_of(cached) == uid
                and cached.get("status", {}).get("phase") not in TERMINAL_PHASES
            ):
                await mark_failed(ctx, name, ctx.ns, action)
            await ctx.calls.run(
                f"delete pod {name}", ctx.core.delete_namespaced_pod, name, ctx.ns, body=options
            )

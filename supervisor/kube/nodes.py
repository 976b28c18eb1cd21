"""Nodes: `cordon`, `uncordon`, and `hot_swap` (the node swapped out for a spare: cordoned,
tainted NoExecute, its pods evicted for their Jobs to place them elsewhere).

A node's changes (`cordon_node`, `swap_out_node`, `restore_node`) are edits of the Node
object, written with the action's journal entry on it in one conditional patch.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from supervisor.action_params import HotSwapParams
from supervisor.actuator.backend import params_for
from supervisor.config_parts import KubernetesSettings
from supervisor.domain import ActionRecord
from supervisor.kube import objects as o
from supervisor.kube import rmw
from supervisor.kube.action_context import ActionContext, Heal, node_name
from supervisor.kube.eviction import evict_targets, running_pods
from supervisor.kube.generations import pods_to_restart
from supervisor.kube.journal import JournalEntry, target_of
from supervisor.kube.objects import Obj
from supervisor.kube.restart import ALREADY_RESTARTED


async def cordon(ctx: ActionContext, action: ActionRecord) -> dict[str, Any]:
    return await _node_action(ctx, action, partial(cordon_node, ctx.settings), "Cordon")


async def uncordon(ctx: ActionContext, action: ActionRecord) -> dict[str, Any]:
    return await _node_action(ctx, action, partial(restore_node, ctx.settings), "Uncordon")


async def _node_action(
    ctx: ActionContext, action: ActionRecord, change: Callable[[Obj], bool], reason: str
) -> dict[str, Any]:
    name, key = node_name(action), action.idempotency_key
    node, entry = await rmw.plan(
        ctx, "Node", name, key, lambda _: JournalEntry(type=action.type.value), also=change
    )
    if entry.done:
        return rmw.repeated(entry)
    spec = node.get("spec", {})
    result = {
        "unschedulable": bool(spec.get("unschedulable")),
        "health": o.labels_of(node).get(ctx.settings.kube_node_health_label),
    }
    await rmw.event(ctx, node, "Node", action, reason, f"node {name}: {result}")
    await rmw.finish(ctx, "Node", name, key, result)
    return result


async def hot_swap(ctx: ActionContext, action: ActionRecord, *, heal: Heal) -> dict[str, Any]:
    """Swap the node out and evict the pods on it (of `action.job`, else of every JobSet
    we watch); on a JobSet that heals in-process, `heal` does it instead."""
    if healed := await heal(action, swap=True):
        return healed
    name, key = node_name(action), action.idempotency_key
    jobset = action.job
    when = await ctx.reference_time(action)

    def plan(_: Obj) -> JournalEntry:
        # Every pod on the node goes, those created after the event too: the node is
        # bad, and our NoExecute taint would evict them anyway. Pods elsewhere are
        # never touched, whatever their generation.
        skipped = None
        if jobset is not None:
            targets = running_pods(ctx, jobset, name)
            js = ctx.discovery.jobset(jobset)
            if not targets and js is not None:
                # Nothing of the job left on the node: restarted elsewhere already?
                verdict = pods_to_restart(ctx.discovery, js, None, when)
                skipped = verdict.skipped or None
        else:
            targets = sorted(
                target_of(p)
                for p in ctx.discovery.pods_on(name)
                if o.jobset_of(p) in ctx.discovery.jobsets() and not o.terminating(p)
            )
        return JournalEntry(type=action.type.value, targets=tuple(targets), skipped=skipped)

    node, entry = await rmw.plan(
        ctx, "Node", name, key, plan, also=partial(swap_out_node, ctx.settings)
    )
    if entry.done:
        return rmw.repeated(entry)
    spare = params_for(action, HotSwapParams).spare
    outcome = await evict_targets(
        ctx, action, entry.targets or (), "HotSwap", f"moving off {name} to a spare"
    )
    result = {"node": name, "spare": spare, "pods": outcome, "spares": ctx.discovery.spares()}
    taint = f"{ctx.settings.kube_taint_key}:NoExecute"
    what = f"node {name} cordoned, tainted {taint}; pods {outcome}"
    if entry.skipped:
        result["skipped"] = f"no pod to move: {entry.skipped}"
        what = f"{what}; {result['skipped']}"
    await rmw.event(ctx, node, "Node", action, "HotSwap", what)
    js = ctx.discovery.jobset(jobset) if jobset else None
    if js is not None:
        await rmw.event(ctx, js, "JobSet", action, "HotSwap", what)
        if entry.skipped:
            await rmw.event(ctx, js, "JobSet", action, ALREADY_RESTARTED, what)
    await rmw.finish(ctx, "Node", name, key, result)
    return result


def cordon_node(settings: KubernetesSettings, node: Obj) -> bool:
    """Unschedulable, health label Unschedulable (a node pending replacement keeps its
    label)."""
    spec = node.setdefault("spec", {})
    changed = not spec.get("unschedulable")
    spec["unschedulable"] = True
    label = o.labels_of(node).get(settings.kube_node_health_label)
    if label != o.PENDING_REPLACEMENT:
        changed = _set_health(settings, node, o.UNSCHEDULABLE) or changed
    return changed


def swap_out_node(settings: KubernetesSettings, node: Obj) -> bool:
    """Cordon, our NoExecute taint, health label UnschedulablePendingReplacement."""
    spec = node.setdefault("spec", {})
    changed = not spec.get("unschedulable")
    spec["unschedulable"] = True
    # spec.taints is an atomic list: the whole list is written back, other taints kept.
    if not o.has_taint(node, settings.kube_taint_key):
        taint = {
            "key": settings.kube_taint_key,
            "value": "hot-swap",
            "effect": "NoExecute",
            "timeAdded": o.rfc3339(),
        }
        spec["taints"] = [*(spec.get("taints") or []), taint]
        changed = True
    return _set_health(settings, node, o.PENDING_REPLACEMENT) or changed


def restore_node(settings: KubernetesSettings, node: Obj) -> bool:
    """Schedulable, our taint gone, health label Schedulable."""
    spec = node.setdefault("spec", {})
    changed = bool(spec.pop("unschedulable", False))
    taints = spec.get("taints") or []
    kept = [t for t in taints if t.get("key") != settings.kube_taint_key]
    if len(kept) != len(taints):
        spec["taints"] = kept
        changed = True
    return _set_health(settings, node, o.SCHEDULABLE) or changed


def _set_health(settings: KubernetesSettings, node: Obj, value: str) -> bool:
    labels = o.meta(node).setdefault("labels", {})
    if labels.get(settings.kube_node_health_label) == value:
        return False
    labels[settings.kube_node_health_label] = value
    return True

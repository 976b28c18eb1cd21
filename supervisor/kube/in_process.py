"""In-process healing of a JobSet: `restart_in_place` and `hot_swap` replace only the pods
of the bad node, and the surviving pods keep their processes and their state.

The JobSet has to allow it (docs/training.md, "In-process recovery on Kubernetes"): annotated
`resiliency.supervisor.io/in-process-restart: "true"`, each Job answering an evicted pod
(DisruptionTarget) with `Ignore` (the Job replaces that pod alone, the JobSet is not
restarted), its workers waiting for their world (WORLD_WAIT_S). Then:

1. The action's journal entry on the JobSet decides the pods to replace (those of the
   node that existed at the event) and the JobSet's next world (attempt + 1, a new
   rendezvous port); the world annotation is then moved to it. A retry decides nothing
   again.
2. For `hot_swap`, the node is cordoned and tainted, as a plain hot swap does.
3. Those pods are evicted (on a node that is down they are then deleted at once: its
   kubelet would never confirm). A Job of that one pod is then deleted, and the JobSet
   controller creates it again once the pod is gone: a Job replaces a failed pod only
   after its pod-failure backoff (10 s, doubled at each failure of the Job and reset only
   by a success: minutes after a few heals), a new Job at once. A Job of several pods
   replaces the pod itself.
4. `pod_links.PodLinks` tells every pod the new world through its node's host monitor:
   the survivors at once, each replacement when it is scheduled.
5. Done when every rank trains in the new world. When that takes longer than
   `in_process_restart_timeout_s`, or a pod of the new world ends before it forms (the
   next pod of its rank would join only the world after), or the JobSet does not allow
   it, or the policy asks for it (`in_process: false`), the JobSet is restarted whole
   instead (its child Jobs deleted and recreated, as a workload restart does; its new pods
   meet in the current world once every old one is gone); the result says which path was
   taken (`path`) and why (`in_process_error`).

A later action for a failure seen before a heal completed is skipped ("healed in-process
since the event"), as one after a JobSet restart is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from functools import partial
from typing import Any, Literal

from supervisor.action_params import HotSwapParams, RestartInPlaceParams
from supervisor.actuator.backend import ActionError, checked_params, params_for
from supervisor.domain import ActionRecord, ActionType
from supervisor.kube import objects as o
from supervisor.kube import rmw
from supervisor.kube.action_context import ActionContext, node_name
from supervisor.kube.discovery import Discovery
from supervisor.kube.errors import KubeError, NotFound
from supervisor.kube.eviction import delete_now, evict_targets, node_up
from supervisor.kube.failure_policy import in_process_refusal
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
from supervisor.kube.pod_links import PodLinks, live_pods
from supervisor.kube.restart import delete_jobs, restart_workload, skip
from supervisor.kube.worlds import World, current_world, healed, healed_since, next_world, set_world

log = logging.getLogger(__name__)

Path = Literal["in_process", "full_restart", "plain"]


def choose_path(action: ActionRecord, js: Obj) -> tuple[Path, str]:
    """How to heal: in-process; a full restart (a JobSet that heals in-process, when it
    cannot this time: why); or the plain way of a JobSet that does not (why, when the
    policy asked for in-process)."""
    params = checked_params(action)
    wanted = params.in_process if isinstance(params, RestartInPlaceParams | HotSwapParams) else None
    if not o.in_process_enabled(js):
        why = f"JobSet {o.name_of(js)} is not annotated {o.IN_PROCESS}: true" if wanted else ""
        return "plain", why
    if wanted is False:
        return "full_restart", "the policy asked for a full restart (in_process: false)"
    refusal = in_process_refusal(js)
    if refusal is not None:
        return "full_restart", refusal
    return "in_process", ""


def sole_pod_jobs(discovery: Discovery, js: Obj, targets: Sequence[Target]) -> tuple[Target, ...]:
    """The JobSet's child Jobs whose every pod is being replaced (`targets`) and which run
    one pod at a time (parallelism and completions 1): deleted, the JobSet controller
    creates them again, and their new pod waits no pod-failure backoff."""
    replaced = {uid for _, uid in targets}
    recreated = recreated_replicated_jobs(js)
    pods_by_job: dict[str, list[str]] = {}
    for pod in discovery.pods_of(o.name_of(js)):
        pods_by_job.setdefault(o.owner_uid(pod) or "", []).append(o.uid_of(pod))
    return tuple(
        sorted(
            target_of(job)
            for job in discovery.child_jobs(o.name_of(js))
            if o.owner_uid(job) == o.uid_of(js)
            and o.labels_of(job).get(o.REPLICATED_JOB_NAME) in recreated
            and one_pod_at_a_time(job)
            and not o.terminating(job)
            and (pods := pods_by_job.get(o.uid_of(job)))
            and set(pods) <= replaced
        )
    )


def recreated_replicated_jobs(js: Obj) -> set[str]:
    """The replicated jobs whose missing Jobs the JobSet controller creates again while the
    JobSet runs: none under the `InOrder` startup policy (once every replica started, it
    creates no more), nor one that `dependsOn` another (created only on that one's
    status)."""
    spec = js.get("spec") or {}
    if (spec.get("startupPolicy") or {}).get("startupPolicyOrder") == "InOrder":
        return set()
    return {
        str(rj.get("name")) for rj in spec.get("replicatedJobs") or [] if not rj.get("dependsOn")
    }


def one_pod_at_a_time(job: Obj) -> bool:
    spec = job.get("spec") or {}
    return spec.get("parallelism", 1) == 1 and spec.get("completions", 1) in (1, None)


class InProcessHealing:
    def __init__(self, ctx: ActionContext, links: PodLinks) -> None:
        self.ctx = ctx
        self.links = links

    async def heal(self, action: ActionRecord, *, swap: bool) -> dict[str, Any] | None:
        """Heal the JobSet of `action` (restart_in_place, or hot_swap with `swap`) when it
        heals in-process; None: a JobSet of the plain kind (the caller acts)."""
        ctx = self.ctx
        jobset, node = action.job, node_name(action)
        js = ctx.discovery.jobset(jobset) if jobset else None
        if js is None:
            return None
        path, why = choose_path(action, js)
        entry = entry_of(js, action.idempotency_key)
        if entry is not None and entry.done:
            return rmw.repeated(entry)
        if path == "plain":
            if why:
                log.warning("%s: not healed in-process: %s", action.idempotency_key, why)
            return None
        fallback = entry.fallback if entry is not None else None
        if path == "full_restart" or fallback:
            return await self._full_restart(action, node, swap, why or str(fallback))
        return await self._in_process(action, node, swap)

    async def _in_process(self, action: ActionRecord, node: str, swap: bool) -> dict[str, Any]:
        ctx = self.ctx
        jobset, key = action.job or "", action.idempotency_key
        when = await ctx.reference_time(action)

        def plan(js: Obj) -> JournalEntry:
            pods = live_pods(ctx.discovery, jobset)
            targets = sorted(
                target_of(p)
                for p in pods
                if o.node_of(p) == node and not ctx.discovery.created_after(p, when)
            )
            entry = JournalEntry(type=action.type.value, since=when.isoformat())
            if not targets and healed_since(js, when):
                now = current_world(js, pods).attempt
                skipped = f"healed in-process since the event (world {now})"
                return dataclasses.replace(entry, skipped=skipped)
            world = next_world(js, pods, [uid for _, uid in targets])
            # Pods of the node that ended by themselves (a crash) are replaced too.
            ended = [
                target_of(p)
                for p in ctx.discovery.pods_of(jobset)
                if o.node_of(p) == node
                and o.pod_finished(p)
                and not ctx.discovery.created_after(p, when)
            ]
            recreated = (
                sole_pod_jobs(ctx.discovery, js, [*targets, *ended])
                if ctx.settings.kube_recreate_replaced_jobs
                else ()
            )
            return dataclasses.replace(
                entry,
                path="in_process",
                targets=tuple(targets),
                jobs=recreated,
                world=dataclasses.asdict(world),
            )

        js, entry = await rmw.plan(ctx, "JobSet", jobset, key, plan)
        if entry.skipped is not None:
            return await skip(ctx, js, action, entry)
        planned = entry.world or {}
        world = World(**{**planned, "replaced": tuple(planned["replaced"])})
        targets = entry.targets or ()

        def move_to_world(js: Obj) -> bool:
            if current_world(js, []).attempt >= world.attempt:
                return False
            set_world(js, world)
            return True

        js = await rmw.modify(ctx, "JobSet", jobset, move_to_world)
        if swap:
            await rmw.modify(ctx, "Node", node, partial(swap_out_node, ctx.settings))
        what = f"replacing the pods of {node} in-process (world {world.attempt})"
        outcome = await evict_targets(ctx, action, targets, "InProcessRestart", what)
        fencing: dict[str, str] | None = None
        if not node_up(ctx, node):
            # Grace 0 only where the old pods cannot still run (node_fencing.py).
            verdict = may_force_delete(ctx.settings, node, ctx.discovery.node(node))
            fencing = verdict.result()
            if verdict.allowed:
                await delete_now(ctx, action, targets)
            else:
                log.warning("%s: pods of %s not force-deleted: %s", key, node, verdict.why)
        await delete_jobs(ctx, entry.jobs or ())
        timeout = ctx.settings.in_process_wait_s
        deadline = time.monotonic() + timeout
        while waiting := await self.links.joined(jobset, world.attempt):
            # A member gone: waiting on would only spend the timeout.
            ended = self.links.ended_member(jobset, world.attempt)
            if ended is not None:
                why = f"pod {ended} of world {world.attempt} ended before ranks {waiting} joined"
            elif time.monotonic() >= deadline:
                why = (
                    f"ranks {waiting} did not join world {world.attempt} within"
                    f" {timeout:g}s (in_process_restart_timeout_s, at most half of"
                    " action_timeout_s)"
                )
            else:
                await asyncio.sleep(0.1)
                continue
            if fencing is not None and fencing["status"] == "waiting":
                why += f" (old pods: {fencing['why']})"
            await self._mark_fallback(jobset, key, why)
            return await self._full_restart(action, node, swap, why)
        result: dict[str, Any] = {
            "path": "in_process",
            "world": world.attempt,
            "pods": outcome,
            "survivors": sorted(
                o.name_of(p)
                for p in live_pods(ctx.discovery, jobset)
                if target_of(p) not in targets and not ctx.discovery.created_after(p, when)
            ),
        }
        if fencing is not None:
            result["old_pods"] = fencing
        if entry.jobs:
            result["recreated_jobs"] = [name for name, _ in entry.jobs]
        if swap:
            result.update(node=node, spare=params_for(action, HotSwapParams).spare)
        what = (
            f"pods {outcome} of {node} replaced; every rank trains in world {world.attempt},"
            f" the survivors in the same processes"
        )
        await rmw.event(ctx, js, "JobSet", action, "InProcessRestart", what)
        if swap and (node_obj := ctx.discovery.node(node)) is not None:
            await rmw.event(ctx, node_obj, "Node", action, "HotSwap", what)

        def mark_healed(js: Obj) -> bool:
            now = current_world(js, [])
            if now.attempt != world.attempt or now.at:
                return False
            set_world(js, healed(now))
            return True

        await rmw.modify(ctx, "JobSet", jobset, mark_healed)
        await rmw.finish(ctx, "JobSet", jobset, key, result)
        return result

    async def _mark_fallback(self, jobset: str, key: str, why: str) -> None:
        def change(js: Obj) -> bool:
            journal = journal_of(js)
            entry = journal.get(key)
            if entry is None or entry.fallback:
                return False
            journal[key] = dataclasses.replace(entry, fallback=why)
            set_journal(js, journal)
            return True

        await rmw.modify(self.ctx, "JobSet", jobset, change)

    async def _full_restart(
        self, action: ActionRecord, node: str, swap: bool, why: str
    ) -> dict[str, Any]:
        """Restart the whole JobSet in a new world (its child Jobs recreated)."""
        ctx = self.ctx
        jobset, key = action.job or "", action.idempotency_key
        log.warning("JobSet %s: %s not healed in-process (%s): restarting it", jobset, key, why)
        if swap:
            await rmw.modify(ctx, "Node", node, partial(swap_out_node, ctx.settings))
        full = dataclasses.replace(
            action, type=ActionType.RESTART_WORKLOAD, idempotency_key=f"{key}/full"
        )
        try:
            restarted = await restart_workload(ctx, full)
        except ActionError as exc:  # the action's error says why it came to this
            raise ActionError(
                f"{exc} (not healed in-process: {why})", retryable=exc.retryable
            ) from exc
        result: dict[str, Any] = {"path": "full_restart", "in_process_error": why, **restarted}
        if swap:
            result.update(node=node, spare=params_for(action, HotSwapParams).spare)
        # The Journal entry of the action itself (the full restart has its own): done, as
        # far as it can be marked; only a JobSet gone meanwhile fails the action.
        try:
            await rmw.plan(
                ctx, "JobSet", jobset, key, lambda _: JournalEntry(type=action.type.value)
            )
            await rmw.finish(ctx, "JobSet", jobset, key, result)
        except NotFound:
            raise
        except (ActionError, KubeError):
            pass
        return result

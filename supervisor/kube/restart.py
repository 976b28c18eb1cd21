"""Restarts: `restart_in_place` (the pods of one node, or of the whole JobSet) and
`restart_workload` (the whole JobSet, as its controller would after a failure).

Generations: a restart acts on the pods or Jobs that existed at the reference time of the
event it answers, never on those the JobSet controller created since; if the JobSet has
restarted by itself meanwhile, the action is skipped (see `generations.py`). The targets,
or why it is skipped, are journalled before anything is touched (`plan_restart`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from kubernetes import client

from supervisor.actuator.backend import ActionError
from supervisor.domain import ActionRecord
from supervisor.kube import objects as o
from supervisor.kube import rmw
from supervisor.kube.action_context import ActionContext, Heal, jobset_name
from supervisor.kube.errors import Conflict, KubeError, NotFound
from supervisor.kube.eviction import evict_targets
from supervisor.kube.failure_policy import eviction_restart_refusal
from supervisor.kube.generations import Verdict, jobs_to_restart, pods_to_restart
from supervisor.kube.journal import JournalEntry, Target, journal_of, target_of
from supervisor.kube.objects import Obj

#: Reason of the Event saying an action was skipped: the JobSet had restarted already.
ALREADY_RESTARTED = "AlreadyRestarted"


class _Unsettled(KubeError):
    """A restart's generation is still being replaced by a controller: wait on."""


async def restart_in_place(
    ctx: ActionContext, action: ActionRecord, *, heal: Heal
) -> dict[str, Any]:
    """Evict the JobSet's pods on `action.node` (all of them without a node) for their
    Jobs to replace; on a JobSet that heals in-process, `heal` does it instead."""
    if action.node and (healed := await heal(action, swap=False)):
        return healed
    jobset, key = jobset_name(action), action.idempotency_key
    when = await ctx.reference_time(action)

    def decide(js: Obj) -> Verdict:
        return pods_to_restart(ctx.discovery, js, action.node, when)

    js, entry = await plan_restart(ctx, action, when, decide)
    if entry.done:
        return rmw.repeated(entry)
    if entry.skipped is not None:
        return await skip(ctx, js, action, entry)
    outcome = await evict_targets(
        ctx, action, entry.targets or (), "RestartInPlace", "restarting the pod's workers"
    )
    result = {"pods": outcome}
    await rmw.event(ctx, js, "JobSet", action, "RestartInPlace", f"pods {outcome}")
    await rmw.finish(ctx, "JobSet", jobset, key, result)
    return result


async def restart_workload(ctx: ActionContext, action: ActionRecord) -> dict[str, Any]:
    """Restart every worker of the JobSet, as the JobSet controller would after a
    failure: with the failure policy of "JobSet requirements", evict the pods of its
    current Jobs, which fails them, and the controller restarts the JobSet without
    counting it toward maxRestarts (`restart-attempt` goes up: workers keyed on it
    start afresh). Without that policy, delete the child Jobs for the controller to
    recreate (`restart-attempt` stays, maxRestarts is untouched either way)."""
    jobset, key = jobset_name(action), action.idempotency_key
    when = await ctx.reference_time(action)

    def decide(js: Obj) -> Verdict:
        # Jobs already being deleted (a restart under way) are waited for like the
        # others: a second restart right after the first would be one too many.
        return jobs_to_restart(ctx.discovery, js, when)

    def how(js: Obj, entry: JournalEntry) -> JournalEntry:
        refusal = eviction_restart_refusal(js)
        return dataclasses.replace(
            entry,
            method="delete_jobs" if refusal else "evict",
            why=refusal or None,
            restarts_before=o.jobset_restarts(js),
        )

    js, entry = await plan_restart(ctx, action, when, decide, how)
    if entry.done:
        return rmw.repeated(entry)
    if entry.skipped is not None:
        return await skip(ctx, js, action, entry)
    targets = entry.targets or ()
    old = {uid for _, uid in targets}
    restarts_before = entry.restarts_before or 0
    pods = sorted(
        target_of(p)
        for p in ctx.discovery.pods_of(jobset)
        if o.owner_uid(p) in old and not o.terminating(p) and not o.pod_finished(p)
    )
    # No pod left to evict (say, a repeat after the evictions): wait for the restart
    # where it is done or under way (a failed Job); else nothing would fail the Jobs,
    # so they are deleted instead.
    current = ctx.discovery.jobset(jobset) or js
    under_way = o.jobset_restarts(current) > restarts_before or any(
        o.job_failed(j) for j in ctx.discovery.child_jobs(jobset) if o.uid_of(j) in old
    )
    by_eviction = entry.method == "evict" and (bool(pods) or under_way)
    result: dict[str, Any]
    if by_eviction:
        outcome = await evict_targets(
            ctx, action, pods, "RestartWorkload", "restarting the JobSet's workers"
        )
        result = {"method": "evict", "pods": outcome}
    else:
        await delete_jobs(ctx, targets)
        result = {"method": "delete_jobs", "deleted_jobs": [n for n, _ in targets]}
    expected_jobs = sum(
        int(r.get("replicas", 1)) for r in js.get("spec", {}).get("replicatedJobs") or []
    )

    def replaced() -> bool:
        current = ctx.discovery.jobset(jobset)
        if by_eviction and (current is None or o.jobset_restarts(current) <= restarts_before):
            return False
        jobs = ctx.discovery.child_jobs(jobset)
        fresh = [j for j in jobs if o.uid_of(j) not in old and not o.terminating(j)]
        return not any(o.uid_of(j) in old for j in jobs) and len(fresh) >= expected_jobs

    limit = ctx.settings.pod_termination_threshold_s
    if not await ctx.discovery.wait_until(replaced, limit):
        left = sorted(o.name_of(j) for j in ctx.discovery.child_jobs(jobset) if o.uid_of(j) in old)
        raise ActionError(
            f"JobSet {jobset}: old Jobs {left} not replaced within"
            f" pod_termination_threshold_s={limit:g}s",
            retryable=True,
        )
    current = ctx.discovery.jobset(jobset) or js
    result["restart_attempt"] = o.jobset_restarts(current)
    if by_eviction:
        what = (
            f"evicted the pods of its Jobs {result['pods']}; the JobSet controller"
            f" restarted it (restart-attempt {result['restart_attempt']})"
        )
    else:
        what = (
            f"deleted child Jobs {result['deleted_jobs']}; the JobSet controller"
            f" recreated them (restart-attempt stays {result['restart_attempt']}:"
            f" {entry.why})"
        )
    await rmw.event(ctx, js, "JobSet", action, "RestartWorkload", what)
    await rmw.finish(ctx, "JobSet", jobset, key, result)
    return result


async def plan_restart(
    ctx: ActionContext,
    action: ActionRecord,
    when: datetime,
    decide: Callable[[Obj], Verdict],
    how: Callable[[Obj, JournalEntry], JournalEntry] | None = None,
) -> tuple[Obj, JournalEntry]:
    """The journal entry of a restart: its targets, or why it is skipped.

    While pods or Jobs of its generation have failed and the Job or JobSet controller
    has not reacted yet (a JobSet restart makes the action a no-op), it waits for
    them, by watching, up to `controller_patience_s`; then it acts, or fails (for
    want of anything to act on). `how` adds what the JobSet says of the way to act
    to an entry with targets. An entry already journalled is taken as it is."""
    jobset, key = jobset_name(action), action.idempotency_key
    deadline = time.monotonic() + ctx.controller_patience_s

    def settled() -> bool:
        js = ctx.discovery.jobset(jobset)
        return js is None or key in journal_of(js) or not decide(js).wait

    def plan(js: Obj) -> JournalEntry:
        verdict = decide(js)
        if verdict.wait and time.monotonic() < deadline:
            raise _Unsettled()
        entry = JournalEntry(
            type=action.type.value,
            since=when.isoformat(),
            restart_attempt=verdict.generation.at_event,
        )
        if verdict.skipped:
            return dataclasses.replace(entry, skipped=verdict.skipped)
        if not verdict.targets:
            raise ActionError(verdict.error or "nothing to restart", retryable=verdict.wait)
        entry = dataclasses.replace(entry, targets=tuple(verdict.targets))
        return how(js, entry) if how else entry

    while True:
        # The watches' streams are separate (a Job may be seen failed before its pod):
        # what the cache said settled may look unsettled on the fresh read.
        await ctx.discovery.wait_until(settled, max(0.0, deadline - time.monotonic()))
        try:
            return await rmw.plan(ctx, "JobSet", jobset, key, plan)
        except _Unsettled:
            await asyncio.sleep(ctx.calls.backoff_s[0])  # the cache lags the read


async def skip(
    ctx: ActionContext, js: Obj, action: ActionRecord, entry: JournalEntry
) -> dict[str, Any]:
    """Done without acting (the entry says why): an Event says so, the journal too."""
    result = {"skipped": str(entry.skipped)}
    what = f"{action.type.value} not done: {result['skipped']}"
    await rmw.event(ctx, js, "JobSet", action, ALREADY_RESTARTED, what)
    await rmw.finish(ctx, "JobSet", o.name_of(js), action.idempotency_key, result)
    return result


async def delete_jobs(ctx: ActionContext, targets: Sequence[Target]) -> None:
    for name, uid in targets:
        # Foreground: the Job stays until its pods are gone, so the JobSet controller
        # recreates it only then, and old and new workers never run side by side.
        options = client.V1DeleteOptions(
            propagation_policy="Foreground", preconditions=client.V1Preconditions(uid=uid)
        )
        # 404/409: gone already, or already replaced by a new Job of that name.
        with contextlib.suppress(NotFound, Conflict):
            await ctx.calls.run(
                f"delete job {name}",
                ctx.batch.delete_namespaced_job,
                name,
                ctx.ns,
                body=options,
            )

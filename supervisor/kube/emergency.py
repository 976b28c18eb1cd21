"""`emergency_checkpoint`: every worker of the JobSet saves its state now, asked through
the host monitors of its nodes (resiliency_protocol.emergency: the same fan-out and rule
of success as the local backend's)."""

from __future__ import annotations

from typing import Any

from resiliency_protocol.emergency import emergency_checkpoint as fan_out
from supervisor.action_params import EmergencyCheckpointParams
from supervisor.actuator.backend import ActionError, Fenced, params_for
from supervisor.domain import ActionRecord
from supervisor.kube import rmw
from supervisor.kube.action_context import ActionContext, jobset_name


async def emergency_checkpoint(ctx: ActionContext, action: ActionRecord) -> dict[str, Any]:
    jobset = jobset_name(action)
    exclude = set(params_for(action, EmergencyCheckpointParams).exclude_nodes)
    nodes = [n for n in ctx.discovery.nodes_of(jobset) if n not in exclude]
    if not nodes:
        raise ActionError(f"no running pod of {jobset} outside {sorted(exclude)}")
    # Leave some of the actuator's time for the answers to come back.
    budget = max(0.5, ctx.settings.emergency_checkpoint_timeout_s * 0.9)
    checkpoint = await fan_out(
        ctx.http,
        {node: ctx.host_monitor_url(node) for node in nodes},
        request_id=action.idempotency_key,
        timeout_s=budget,
        http_timeout_s=budget + 2,
        before_each=lambda: ctx.calls.fence(),
        reraise=(Fenced,),
    )
    js = ctx.discovery.jobset(jobset)
    if checkpoint.takes_none:
        # Its workers registered without a SIGUSR1 handler: nothing failed, and the remedy
        # after it goes on as it would after a save.
        note = checkpoint.none_asked(jobset)
        if js is not None and jobset not in ctx.told_no_emergency:
            ctx.told_no_emergency.add(jobset)
            await rmw.event(ctx, js, "JobSet", action, "NoEmergencyCheckpoints", note)
        return {
            "nodes": nodes,
            "acked_ranks": [],
            "steps": [],
            "emergency_checkpoints": False,
            "note": note,
        }
    if not checkpoint.succeeded:
        what = f"emergency checkpoint incomplete: {checkpoint.failure}"
        if js is not None:
            await rmw.event(
                ctx, js, "JobSet", action, "EmergencyCheckpointFailed", what, warning=True
            )
        raise ActionError(what)
    saved, steps = checkpoint.saved, checkpoint.steps
    if js is not None:
        await rmw.event(
            ctx,
            js,
            "JobSet",
            action,
            "EmergencyCheckpoint",
            f"{len(saved)} workers on {len(nodes)} nodes saved step(s) {steps}",
        )
    return {"nodes": nodes, "acked_ranks": [str(r) for r in sorted(saved)], "steps": steps}

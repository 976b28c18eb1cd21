"""Never scale a job below `floor` data-parallel replicas.

Wraps `DefaultPolicy`: whenever the default would scale a job down to fewer than `floor`
replicas, this policy restarts the workload instead (still after an emergency checkpoint).
Useful when a job's global batch or learning-rate schedule cannot tolerate fewer replicas,
tighter than the job's own `min_num_dp_replicas`.

Use it with

    SUPERVISOR_POLICY=policies.examples.never_scale_below:NeverScaleBelow

or copy this file, edit `floor` and point at the copy by path (the `policies` package must
still be importable, as it is where the supervisor is installed):

    SUPERVISOR_POLICY=/path/to/never_scale_below.py:NeverScaleBelow
"""

from __future__ import annotations

from policies.default import DefaultPolicy
from supervisor.domain import ActionRequest, ActionType, Event
from supervisor.policy import PolicyContext, actions


class NeverScaleBelow(DefaultPolicy):
    """`DefaultPolicy` with every scale-down below `floor` replaced by a workload restart."""

    name = "never_scale_below"
    floor: int = 3

    def event_policy(self, event: Event, context: PolicyContext) -> list[ActionRequest]:
        out: list[ActionRequest] = []
        for action in super().event_policy(event, context):
            to = action.params.get("to_replicas")
            if action.type is ActionType.SCALE_DOWN and isinstance(to, int) and to < self.floor:
                restart = actions.restart_workload(
                    action.job,
                    reason=f"{action.reason}; but {to} < floor={self.floor}: restarting instead",
                )
                if out and out[-1].type is ActionType.EMERGENCY_CHECKPOINT:
                    # Keep the checkpoint the default put in front of the scale-down.
                    out.append(restart)
                else:
                    failed = action.params.get("exclude_node")
                    out += self.remedy(context, restart, failed_node=failed)
            else:
                out.append(action)
        return out

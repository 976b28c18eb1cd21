"""Hot-swap a node at once on GPU XIDs that mean the GPU is gone.

XID 48 (double-bit ECC error) and XID 79 (GPU fell off the bus) do not heal with a restart,
so this policy skips the default restart rung for them: it checkpoints the healthy workers
and hot-swaps the node to a spare right away (no spare: scale down, else restart the
workload). Other XIDs, and everything else, follow `DefaultPolicy`.

Use it with

    SUPERVISOR_POLICY=policies.examples.hot_swap_on_xid:HotSwapOnXid

or copy this file, edit it and point at the copy by path (the `policies` package must still
be importable, as it is where the supervisor is installed):

    SUPERVISOR_POLICY=/path/to/hot_swap_on_xid.py:HotSwapOnXid
"""

from __future__ import annotations

from policies.default import DefaultPolicy
from supervisor.domain import ActionRequest, Event, EventType
from supervisor.event_details import GpuXidDetails
from supervisor.policy import PolicyContext


class HotSwapOnXid(DefaultPolicy):
    """`DefaultPolicy`, but XIDs in `immediate_xids` evict the node without a restart first."""

    name = "hot_swap_on_xid"
    immediate_xids: frozenset[int] = frozenset({48, 79})

    def node_failure_in_job(
        self, event: Event, ctx: PolicyContext, job: str, node: str
    ) -> list[ActionRequest]:
        # Called by the default GPU_XID handler once it has ruled out a spare node (cordoned)
        # and a spent restart budget (nothing disruptive), so only the ladder changes here.
        if event.type is EventType.GPU_XID and self._xid(event) in self.immediate_xids:
            return self.evict(event, ctx, job, node, "fatal XID, swapping without restart")
        return super().node_failure_in_job(event, ctx, job, node)

    @staticmethod
    def _xid(event: Event) -> int | None:
        return GpuXidDetails.of(event).code

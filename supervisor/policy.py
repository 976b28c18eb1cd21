"""What a policy is written against: the `Policy` base class and the read-only context.

A policy maps one event to a list of `ActionRequest`s. It sees the cluster through a
`PolicyContext` snapshot that holds plain values only, so a policy cannot do I/O through
it and is trivial to unit-test.

    from supervisor.policy import Policy, PolicyContext, handles, actions
    from supervisor.domain import Event, EventType

    class MyPolicy(Policy):
        @handles(EventType.GPU_XID)
        def on_xid(self, event: Event, ctx: PolicyContext) -> list[ActionRequest]:
            return [actions.hot_swap(event.job, event.node, reason="xid")]

An event's details are read typed through its model in supervisor.event_details (for
example `GpuXidDetails.of(event).code`); supervisor.action_params holds the params of
each action type.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from supervisor.action_params import (
    EmergencyCheckpointParams,
    ForceDeletePodParams,
    HotSwapParams,
    RestartInPlaceParams,
    ScaleDownParams,
    ScaleUpParams,
)
from supervisor.domain import (
    ActionRequest,
    ActionType,
    Event,
    EventType,
    JobView,
    NodeView,
)

__all__ = [
    "ActionRequest",
    "Policy",
    "PolicyContext",
    "PolicyLimits",
    "actions",
    "handles",
]


@dataclass(frozen=True, slots=True)
class PolicyLimits:
    """The remediation settings a policy honours (see docs/configuration.md)."""

    max_in_job_restarts: int
    max_workload_restarts: int
    enable_workload_scaling: bool
    restart_window_s: float
    max_restarts_in_window: int
    max_no_progress_restarts: int = 3


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """A snapshot of the cluster taken just before the policy runs."""

    now: datetime
    limits: PolicyLimits
    nodes: Mapping[str, NodeView] = field(default_factory=dict)
    jobs: Mapping[str, JobView] = field(default_factory=dict)
    # Failures recorded per node in the database, the event being handled included.
    node_failures: Mapping[str, int] = field(default_factory=dict)
    # Actions recorded per (job, action type) so far, e.g. in-job restarts; the actions
    # of the event being handled are not counted yet.
    action_counts: Mapping[tuple[str, ActionType], int] = field(default_factory=dict)
    # Disruptive actions per job within limits.restart_window_s before `now`.
    restarts_in_window: Mapping[str, int] = field(default_factory=dict)
    # Remedies per job in a row that were not followed by training progress (every rank
    # past the step it stood at when the remedy was decided).
    no_progress_restarts: Mapping[str, int] = field(default_factory=dict)
    # Jobs whose latest disruptive action (a restart, a swap, a scale) failed: what was
    # stopped for it may not have started again, and nothing else will start it.
    failed_last_remedy: frozenset[str] = frozenset()

    @property
    def spares(self) -> tuple[str, ...]:
        """Healthy, uncordoned spare nodes, by name."""
        return tuple(sorted(n.name for n in self.nodes.values() if n.is_usable_spare))

    def node(self, name: str | None) -> NodeView | None:
        return self.nodes.get(name) if name else None

    def job(self, name: str | None) -> JobView | None:
        return self.jobs.get(name) if name else None

    def failures_of(self, node: str | None) -> int:
        return self.node_failures.get(node, 0) if node else 0

    def count(self, job: str | None, action: ActionType) -> int:
        return self.action_counts.get((job, action), 0) if job else 0

    def in_job_restarts(self, job: str | None) -> int:
        return self.count(job, ActionType.RESTART_IN_PLACE)

    def workload_restarts(self, job: str | None) -> int:
        return self.count(job, ActionType.RESTART_WORKLOAD)

    def recent_restarts(self, job: str | None) -> int:
        return self.restarts_in_window.get(job, 0) if job else 0

    def restarts_without_progress(self, job: str | None) -> int:
        return self.no_progress_restarts.get(job, 0) if job else 0


Handler = Callable[[Any, Event, PolicyContext], list[ActionRequest]]
H = TypeVar("H", bound=Handler)

_HANDLED_ATTR = "__handles_events__"


def handles(*types: EventType) -> Callable[[H], H]:
    """Register a method of a Policy subclass as the handler of these event types."""

    def mark(func: H) -> H:
        setattr(func, _HANDLED_ATTR, frozenset(types))
        return func

    return mark


class Policy:
    """Base class of all policies.

    Subclasses either decorate methods with `@handles(...)` or override `event_policy`.
    Events with no handler produce no action.
    """

    name: str = "policy"
    _handlers: dict[EventType, str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        handlers: dict[EventType, str] = {}
        for klass in reversed(cls.__mro__):
            for attr, value in vars(klass).items():
                for event_type in getattr(value, _HANDLED_ATTR, ()):
                    handlers[event_type] = attr
        cls._handlers = handlers

    def event_policy(self, event: Event, context: PolicyContext) -> list[ActionRequest]:
        attr = self._handlers.get(event.type)
        if attr is None:
            return []
        handler: Callable[[Event, PolicyContext], list[ActionRequest]] = getattr(self, attr)
        return list(handler(event, context))


Policy._handlers = {}


class actions:
    """Constructors for the actions a policy may request; each action's params are built
    from its model in supervisor.action_params."""

    @staticmethod
    def emergency_checkpoint(
        job: str | None, *, exclude_nodes: tuple[str, ...] = (), reason: str = ""
    ) -> ActionRequest:
        """Ask the job's healthy workers to save a checkpoint now."""
        return ActionRequest(
            ActionType.EMERGENCY_CHECKPOINT,
            job=job,
            params=EmergencyCheckpointParams(exclude_nodes=sorted(exclude_nodes)).mapping(),
            reason=reason,
        )

    @staticmethod
    def restart_in_place(
        job: str | None,
        node: str | None = None,
        *,
        reason: str = "",
        in_process: bool | None = None,
    ) -> ActionRequest:
        """`in_process`: True asks the backend to heal in-process (the survivors keep their
        processes), False for a full restart; None: the job's default."""
        params = RestartInPlaceParams(in_process=in_process).mapping()
        return ActionRequest(
            ActionType.RESTART_IN_PLACE, job=job, node=node, params=params, reason=reason
        )

    @staticmethod
    def restart_workload(job: str | None, *, reason: str = "") -> ActionRequest:
        return ActionRequest(ActionType.RESTART_WORKLOAD, job=job, reason=reason)

    @staticmethod
    def hot_swap(
        job: str | None,
        node: str | None,
        *,
        spare: str | None = None,
        reason: str = "",
        in_process: bool | None = None,
    ) -> ActionRequest:
        """`in_process` as for `restart_in_place`."""
        params = HotSwapParams(spare=spare or None, in_process=in_process).mapping()
        return ActionRequest(ActionType.HOT_SWAP, job=job, node=node, params=params, reason=reason)

    @staticmethod
    def scale_down(
        job: str | None, *, to_replicas: int, exclude_node: str | None = None, reason: str = ""
    ) -> ActionRequest:
        params = ScaleDownParams(
            to_replicas=to_replicas, exclude_node=exclude_node or None
        ).mapping()
        return ActionRequest(ActionType.SCALE_DOWN, job=job, params=params, reason=reason)

    @staticmethod
    def scale_up(job: str | None, *, to_replicas: int, reason: str = "") -> ActionRequest:
        return ActionRequest(
            ActionType.SCALE_UP,
            job=job,
            params=ScaleUpParams(to_replicas=to_replicas).mapping(),
            reason=reason,
        )

    @staticmethod
    def cordon(node: str, *, reason: str = "") -> ActionRequest:
        return ActionRequest(ActionType.CORDON, node=node, reason=reason)

    @staticmethod
    def uncordon(node: str, *, reason: str = "") -> ActionRequest:
        return ActionRequest(ActionType.UNCORDON, node=node, reason=reason)

    @staticmethod
    def force_delete_pod(
        job: str | None,
        node: str | None,
        *,
        pod: str,
        namespace: str | None = None,
        uid: str | None = None,
        reason: str = "",
    ) -> ActionRequest:
        """Delete a pod stuck terminating at once (grace period 0), that very pod only."""
        params = ForceDeletePodParams(pod=pod, namespace=namespace, uid=uid).mapping()
        return ActionRequest(
            ActionType.FORCE_DELETE_POD, job=job, node=node, params=params, reason=reason
        )

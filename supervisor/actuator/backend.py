"""The one interface every backend implements (dry-run, local processes, Kubernetes,
simulated), and the shape of the table each declares from action type to handler."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

from resiliency_protocol.faults import FaultKind
from supervisor.action_params import ActionParams, InvalidParams, check_params, params_of
from supervisor.domain import ActionRecord, ActionRequest, ActionType, Event, JobView
from supervisor.errors import SupervisorError

P = TypeVar("P", bound=ActionParams)
#: What a backend's handlers act on: the backend itself, or the cluster it drives.
T = TypeVar("T")


class ActionError(SupervisorError):
    """An action could not be carried out. `retryable` errors are tried again."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class Fenced(SupervisorError):
    """This replica may no longer act: its leadership has lapsed (e.g. it was frozen for
    longer than the Lease lasts) and another replica may be acting already. The action
    is left as it stands in the store, for the leader to resume."""


def checked_params(action: ActionRecord) -> ActionParams:
    """The action's params, typed by its type (supervisor.action_params): how a backend
    reads them. Params that do not fit are an ActionError, not retried."""
    try:
        return check_params(action.type, action.params)
    except InvalidParams as exc:
        raise ActionError(str(exc)) from None


def params_for(action: ActionRecord, model: type[P]) -> P:
    """`checked_params` for a backend that already knows the action's type."""
    try:
        return params_of(action, model)
    except (InvalidParams, TypeError) as exc:
        raise ActionError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class Refused:
    """An action type a backend cannot do, said in its table (with why) rather than left
    out: every table names every action type (tests/test_action_dispatch.py)."""

    why: str


#: Carries out one action on `T`; returns the result stored with the action.
ActionHandler = Callable[[T, ActionRecord], Awaitable[Mapping[str, Any]]]
#: Each action type to its handler, or to the reason the backend refuses it.
ActionTable = Mapping[ActionType, ActionHandler[T] | Refused]


async def dispatch(
    backend: str, table: ActionTable[T], target: T, action: ActionRecord
) -> Mapping[str, Any]:
    """Hand `action` to its handler in `table`; a type the table refuses, or lacks, is an
    ActionError naming the type and the backend (not retried: it would fail again)."""
    entry = table.get(action.type)
    if entry is None or isinstance(entry, Refused):
        why = entry.why if entry is not None else "it has no handler for it"
        raise ActionError(f"the {backend} backend cannot {action.type.value}: {why}")
    return await entry(target, action)


#: Raises Fenced when this replica may no longer act; called before every attempt and
#: every call a backend makes to the outside world.
Fence = Callable[[], None]


def no_fence() -> None:
    """The fence of a replica that is the only one (no leader election)."""


@dataclass(frozen=True, slots=True)
class BackendHooks:
    """What the supervisor offers a backend when it starts acting."""

    #: Raise events: they are recorded in the store, in order, then given to the policy.
    raise_events: Callable[[list[Event]], None]
    #: Record an action (idempotent by key) and queue it, as an operator's request is.
    request_action: Callable[[ActionRequest, str], Awaitable[None]]
    #: The host monitor's URL on a node, as its heartbeat gives it (None: unknown).
    node_address: Callable[[str], str | None]
    #: Whether a node's host monitor is heartbeating (None: no host monitor known).
    node_heartbeating: Callable[[str], bool | None]
    #: A recorded event, by id (None: unknown): an action taken for it acts on what
    #: existed at its time, not on what was created since.
    event: Callable[[int], Awaitable[Event | None]] | None = None
    #: Checked before each call to the outside world (see `Fenced`).
    fence: Fence = no_fence


@dataclass(frozen=True, slots=True)
class ClusterNode:
    """A node as a backend that watches the cluster sees it (Kubernetes)."""

    #: Kept off for new work: cordoned, or tainted by the supervisor.
    cordoned: bool
    #: Schedulable and running no workload: a spare, if its host monitor is alive.
    spare: bool


class WorldStarted(Protocol):
    """Told that `job` runs in `world` from now on. `run`: which run of the job the world
    counts in (a Kubernetes JobSet's UID); a job made again counts its worlds afresh."""

    def __call__(self, job: str, world: int, run: str | None = None) -> None: ...


class Backend(ABC):
    """Carries out actions against the real world.

    `execute` must be idempotent per `action.idempotency_key`: the supervisor may call it
    again for the same action after a crash or a retry, and the effect must be that of
    one call. It returns a small JSON-able result that is stored with the action, and
    raises `ActionError` on failure. The actuator bounds each call with a timeout.
    Each backend hands actions on through its `ActionTable` (see `dispatch`).
    """

    name: ClassVar[str]
    #: Every action type to its handler, or to why this backend refuses it (`dispatch`).
    actions: ClassVar[ActionTable[Any]]
    #: Fault kinds this backend can act out on real processes (see `inject_fault`).
    process_faults: ClassVar[frozenset[FaultKind]] = frozenset()
    #: It carries nothing out: the supervisor that runs it is a dry run (its actions are
    #: marked so and counted apart, and move no node in its picture).
    dry_run: ClassVar[bool] = False

    @abstractmethod
    async def execute(self, action: ActionRecord) -> Mapping[str, Any]: ...

    async def inject_fault(
        self, kind: FaultKind, node: str, params: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        """Act out a process-level fault on a node (kill, hang, slow a worker, ...).

        Backends that run no processes of their own cannot, and say so.
        """
        raise ActionError(f"the {self.name} backend cannot inject {kind} faults")

    #: Told of each newer world of a job the backend starts (see `follow_worlds`).
    _world_started: WorldStarted | None = None

    def follow_worlds(self, started: WorldStarted) -> None:
        """Tell `started(job, world)` the newest world of each job now, and of every newer
        one this backend starts, before any rank of it starts: reports from the older
        worlds are refused from then on (supervisor/sensor/worlds.py)."""
        self._world_started = started
        for job, world in self.worlds().items():
            started(job, world)

    def worlds(self) -> Mapping[str, int]:
        """The newest world of each job, as this backend keeps it; {} when it does not."""
        return {}

    def world_started(self, job: str, world: int, run: str | None = None) -> None:
        if self._world_started is not None:
            self._world_started(job, world, run)

    def act_in_epoch(self, epoch: int | None) -> None:  # noqa: B027 - optional hook
        """Send `epoch` with every command to host monitors from now on (called before
        any action runs; supervisor/actuator/leader_epoch.py). None: a dry run's."""

    async def start(self, hooks: BackendHooks) -> None:  # noqa: B027 - optional hook
        """Start watching the cluster, if this backend does (called once, on start)."""

    def job_views(self) -> Mapping[str, JobView]:
        """Jobs as the backend sees them (replicas, bounds, nodes); {} when it does not."""
        return {}

    def cluster_nodes(self) -> Mapping[str, ClusterNode]:
        """Nodes as the backend sees them (cordoned, spare); {} when it does not."""
        return {}

    async def close(self) -> None:  # noqa: B027 - optional hook, nothing to release here
        """Release connections and child processes."""
